"""Small shared helpers with no domain knowledge."""
