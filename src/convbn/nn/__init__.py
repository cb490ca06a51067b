"""convbn.nn."""
