// How an op names itself in errors and traces (OpInfo.hpp).
#include "myccl/OpInfo.hpp"

#include <sstream>

namespace myccl {

std::string OpInfo::describe() const {
  std::ostringstream os;
  os << op << " #" << seq << " (rank " << rank << ", group '" << group << "')";
  return os.str();
}

}  // namespace myccl
