// Interface selection, host identity and random secrets.
#include "myccl/cpu/transport/Net.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <sstream>

#include "myccl/Errors.hpp"

namespace myccl::cpu {

namespace {

std::vector<std::string> splitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ','))
    if (!item.empty()) out.push_back(item);
  return out;
}

// NCCL_SOCKET_IFNAME semantics: prefixes by default, "=" for exact names, "^" to exclude.
bool ifnameMatches(const std::string& spec, const std::string& name) {
  std::string s = spec;
  bool exclude = false, exact = false;
  if (!s.empty() && s[0] == '^') exclude = true, s = s.substr(1);
  if (!s.empty() && s[0] == '=') exact = true, s = s.substr(1);
  bool hit = false;
  for (const auto& item : splitComma(s)) hit |= exact ? (name == item) : (name.rfind(item, 0) == 0);
  return exclude ? !hit : hit;
}

std::string routeTo(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), "9", &hints, &res) != 0 || res == nullptr) return "";
  std::string out;
  for (addrinfo* ai = res; ai && out.empty(); ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
      sockaddr_storage ss{};
      socklen_t len = sizeof(ss);
      if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) {
        char buf[INET6_ADDRSTRLEN] = {0};
        if (ss.ss_family == AF_INET)
          inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
        else
          inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
        out = buf;
      }
    }
    ::close(fd);
  }
  freeaddrinfo(res);
  return out;
}

std::string readFirstLine(const char* path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return line;
}

}  // namespace

std::vector<Interface> listInterfaces() {
  std::vector<Interface> out;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return out;
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || !(i->ifa_flags & IFF_UP)) continue;
    int fam = i->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    char buf[INET6_ADDRSTRLEN] = {0};
    if (fam == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr, buf, sizeof(buf));
    } else {
      auto* in6 = reinterpret_cast<sockaddr_in6*>(i->ifa_addr);
      if (IN6_IS_ADDR_LINKLOCAL(&in6->sin6_addr)) continue;  // needs a scope id; not worth it
      inet_ntop(AF_INET6, &in6->sin6_addr, buf, sizeof(buf));
    }
    out.push_back(Interface{i->ifa_name, buf, (i->ifa_flags & IFF_LOOPBACK) != 0, fam == AF_INET6});
  }
  freeifaddrs(ifs);
  // IPv4 first: it is what most clusters route.
  std::stable_sort(out.begin(), out.end(), [](const Interface& a, const Interface& b) { return !a.ipv6 && b.ipv6; });
  return out;
}

std::string chooseListenAddress(const std::string& ifnameSpec, const std::string& masterAddr) {
  auto ifs = listInterfaces();
  if (!ifnameSpec.empty()) {
    for (const auto& i : ifs)
      if (ifnameMatches(ifnameSpec, i.name)) return i.address;
    std::ostringstream seen;
    for (const auto& i : ifs) seen << " " << i.name << "=" << i.address;
    MYCCL_CHECK_ARG(false, "MYCCL_SOCKET_IFNAME='", ifnameSpec, "' matches no interface that is up (seen:",
                    seen.str(), ")");
  }
  if (!masterAddr.empty()) {
    std::string a = routeTo(masterAddr);
    if (!a.empty()) return a;
  }
  for (const auto& i : ifs)
    if (!i.loopback) return i.address;
  return "127.0.0.1";
}

std::string hostIdentity(const std::string& override) {
  if (!override.empty()) return override;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  std::string boot = readFirstLine("/proc/sys/kernel/random/boot_id");
  struct stat st {};
  std::string netns = (stat("/proc/self/ns/net", &st) == 0) ? std::to_string(st.st_ino) : "?";
  return std::string(host) + "/" + boot + "/netns:" + netns;
}

std::string randomHex(size_t nbytes) {
  std::string raw(nbytes, '\0');
  size_t got = 0;
  while (got < nbytes) {
    ssize_t r = getrandom(raw.data() + got, nbytes - got, 0);
    MYCCL_CHECK(r > 0 || errno == EINTR, "getrandom failed: ", strerror(errno));
    if (r > 0) got += static_cast<size_t>(r);
  }
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(2 * nbytes);
  for (unsigned char c : raw) {
    out.push_back(hex[c >> 4]);
    out.push_back(hex[c & 15]);
  }
  return out;
}

}  // namespace myccl::cpu
