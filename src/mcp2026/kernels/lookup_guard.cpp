// LookupGuard (cpu_kernels.h): a decode step's "is the model still what the compiled stack was built from"
// check as borrowed-reference dictionary reads, without the interpreter's per-lookup work.

#include <torch/extension.h>

#include "cpu_kernels.h"

namespace {

// The step has just streamed the model's weights, so the dicts are out of the caches: their objects and key
// tables are fetched a few reads ahead (each read is a chain of dependent loads: dict, keys, entry).
constexpr size_t kAhead = 8;

inline void prefetch_dict(PyObject* d) { __builtin_prefetch(d); }

inline void prefetch_keys(PyObject* d) {
  const char* keys = reinterpret_cast<const char*>(reinterpret_cast<PyDictObject*>(d)->ma_keys);
  for (int line = 0; line < 4; ++line) __builtin_prefetch(keys + 64 * line);  // a small dict's whole table
}

}  // namespace

bool LookupGuard::holds() const {
  const size_t n = dicts.size();
  for (size_t i = 0; i < std::min(n, 2 * kAhead); ++i) prefetch_dict(dicts[i].ptr());
  for (size_t i = 0; i < std::min(n, kAhead); ++i) prefetch_keys(dicts[i].ptr());
  for (const auto& d : empty) prefetch_dict(d.ptr());
  for (size_t i = 0; i < n; ++i) {
    if (i + 2 * kAhead < n) prefetch_dict(dicts[i + 2 * kAhead].ptr());
    if (i + kAhead < n) prefetch_keys(dicts[i + kAhead].ptr());
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
