"""A domain of cuda-backend daemons on one GPU machine: a job that spans two of them needs
fabric handles, which need an IMEX channel; where the driver refuses them (no IMEX channel,
as on a machine outside a multi-node NVLink domain) the job is refused on every node with a
message naming the channel, and a job held by one node runs as usual."""

from __future__ import annotations

import os

import pytest
import torch

from a2ad import errors
from helpers import DaemonProcess
from test_domain import Cluster, _attach_in_thread

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class CudaCluster(Cluster):
    def start(self, node, config=None, env=None, *args):
        d = DaemonProcess(self.dirs[node], "--backend", "cuda", "--grace", "5", "--domain", str(config or self.config),
                          "--node", node, *args, env={**os.environ, **(env or {})})
        self.daemons[node] = d
        d.start(timeout=60)
        return d


def test_a_spanning_job_without_an_imex_channel_is_refused_naming_it(tmp_path):
    c = CudaCluster(tmp_path, ["a", "b"])
    n = torch.cuda.device_count()
    try:
        c.start("a")
        c.start("b")
        c.wait_up("ab")
        got: dict = {}
        ths = [_attach_in_thread("span", r, 2, c.dirs["ab"[r]], got, device=torch.device("cuda", r % n))
               for r in (0, 1)]
        for th in ths:
            th.join(60)
        assert set(got) == {0, 1}, got
        for r in (0, 1):
            assert isinstance(got[r], errors.BackendError), got
            assert "IMEX channel" in got[r].message and "no fabric handle" in got[r].message, got[r].message
        print(f"\na spanning job on this GPU machine: {got[0].message}")
        local: dict = {}
        ths = [_attach_in_thread("only-a", r, 2, c.dirs["a"], local, device=torch.device("cuda", r % n))
               for r in (0, 1)]
        for th in ths:
            th.join(60)
        try:
            assert all(not isinstance(local[r], Exception) for r in (0, 1)), local
        finally:
            for a in local.values():
                if not isinstance(a, Exception):
                    a.close()
    finally:
        c.close()
