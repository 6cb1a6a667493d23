"""`tpugen serve`: a warm server that pays each compile once per machine (FastAPI on uvicorn)."""
