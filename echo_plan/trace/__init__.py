"""Ex-situ tracing: real PyTorch module code run under FakeTensorMode and a fake process group."""
