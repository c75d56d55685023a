// LookupGuard (cpu_kernels.h): a decode step's "is the model still what the compiled stack was built from"
// check as borrowed-reference dictionary reads, without the interpreter's per-lookup work.

#include <torch/extension.h>

#include "cpu_kernels.h"

bool LookupGuard::holds() const {
  for (size_t i = 0; i < dicts.size(); ++i) {
    PyObject* got = PyDict_GetItemWithError(dicts[i].ptr(), keys[i].ptr());  // borrowed
    if (got == nullptr) {
      if (PyErr_Occurred()) throw pybind11::error_already_set();
      if (values[i].ptr() != missing.ptr()) return false;
    } else if (got != values[i].ptr()) {
      return false;
    }
  }
  for (const auto& d : empty)
    if (PyDict_GET_SIZE(d.ptr()) != 0) return false;
  return true;
}
