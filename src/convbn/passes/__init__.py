"""convbn.passes."""
