"""Schedule simulation: what a PP/VPP schedule keeps in flight, the static buffers it needs, and
their pictures (``mhc-cg schedule``)."""
