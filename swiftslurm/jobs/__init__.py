"""Sending and reading jobs: the first step before anything is sent (prepare), sending a plan (send), what was sent and its
tasks' state (record), and what a TARGET (a job id or an output dir) names (target)."""
