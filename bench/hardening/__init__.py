"""The hardening bench (issue 16): see __main__.py and README.md."""
