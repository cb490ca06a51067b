"""convbn.autograd."""
