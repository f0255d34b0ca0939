// Network helpers for bootstrapping transports: which interface to listen on, what "this
// host" means (ranks on one host share memory), and the group's secret.
#pragma once

#include <string>
#include <vector>

namespace myccl::cpu {

struct Interface {
  std::string name;
  std::string address;  // numeric IPv4 or IPv6
  bool loopback = false;
  bool ipv6 = false;
};

std::vector<Interface> listInterfaces();

// Picks the address a TCP listener binds to.
//  ifnameSpec: MYCCL_SOCKET_IFNAME ("eth0", "eth,ib" prefixes, "=eth0" exact, "^docker,lo"
//              excludes); empty means: the interface routing to masterAddr, else the first
//              non-loopback interface, else loopback.
// Throws a ValueError naming the spec and the interfaces seen when nothing matches.
std::string chooseListenAddress(const std::string& ifnameSpec, const std::string& masterAddr);

// Same host = same kernel boot, same network namespace, same hostname (network namespaces
// are separate hosts: traffic between them must cross the network). `override` wins.
std::string hostIdentity(const std::string& override);

// Cryptographically random bytes as lowercase hex (2 * nbytes characters).
std::string randomHex(size_t nbytes);

}  // namespace myccl::cpu
