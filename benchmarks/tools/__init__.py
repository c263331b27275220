"""Tools: SASS of the kernels, Nsight Compute launches, profiles, probes and tile sweeps."""
