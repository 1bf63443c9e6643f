"""Test-time tools: scripts that may import the oracle (ExecuTorch), never the product."""
