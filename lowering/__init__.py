"""lowerflow's compiler library: ExecuTorch's lowering stages on torch alone."""
