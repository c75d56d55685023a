"""Hand-written kernels (C++ for the CPU decode step), built on first use; see kernels.cpu."""
