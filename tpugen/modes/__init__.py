"""Ways of running: each only arranges engines and run sessions (single, multi, pod, and the server)."""
