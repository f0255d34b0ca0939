// The parts of the module c10d_ext._C defined outside Bindings.cpp, one function per area.
#pragma once

#include <pybind11/pybind11.h>

void bindReducer(pybind11::module& m);
void bindMemory(pybind11::module& m);
void bindHorovod(pybind11::module& m);
void bindHorovodHeld(pybind11::module& m);
void bindDevice(pybind11::module& m);
