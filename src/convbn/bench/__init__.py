"""convbn.bench."""
