"""Model architectures: a registry from architecture names to implementations."""
