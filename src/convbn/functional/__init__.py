"""convbn.functional."""
