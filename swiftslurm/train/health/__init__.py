"""What watches a run: metrics, the progress watchdog, flight records, GPU sampling, the deadline save, shutdown."""
