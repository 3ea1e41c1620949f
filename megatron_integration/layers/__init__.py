"""mHC layers as megatron-core layer specs (mhc_cg's and Megatron-LM main's), and the step
adapters through which every mhc_cg runtime runs them."""
