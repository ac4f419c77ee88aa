"""Usage: the one record per request (``records``), the daily rollups and report queries (``reports``),
Prometheus metrics (``metrics``) and the health checks (``health``).
"""
