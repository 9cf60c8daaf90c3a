"""Probe what the cuda backend relies on, on a real GPU machine, in one go.

    python -m a2ad.bench.probe [--json out.json]

It checks the driver and every visible GPU, POSIX-fd and fabric export, the daemon's
per-GPU context overhead (in fresh processes, as the daemon), an export/import round
trip across processes, and cross-GPU writes through ``cuMemSetAccess``; it ends with a
PASS/FAIL summary and exits 1 when a required check failed, or at once, with the reason
on one line, where CUDA is unavailable. The modules: ``children`` (the bodies that run in
child processes, and the child-runner), ``checks`` (the checks and their record), ``cli``
(options, the run and its summary).
"""
