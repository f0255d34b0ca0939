// The link probe behind MYCCL_HIERARCHICAL=auto (private to src/cpu/algorithms): the figures the
// choice between two levels and flat algorithms rests on; Select.cpp decides from them.
#pragma once

#include "myccl/cpu/algorithms/Algorithms.hpp"
#include "myccl/cpu/algorithms/LinkModel.hpp"

namespace myccl::cpu::hier {

// Collective: every rank of the group measures at the same op and gets the same figures.
// declaredLinkBytesPerS > 0 (MYCCL_LINK_MBIT) stands for the measurement across hosts.
LinkModel measureLink(CollCtx& c, double declaredLinkBytesPerS);

}  // namespace myccl::cpu::hier
