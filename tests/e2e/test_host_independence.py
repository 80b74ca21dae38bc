"""The unit tests hold on any x86 host, not only the one they were written on.

FP8 rounding flips with a GEMM's or a reduction's summation order, and that order changes with the SIMD
width PyTorch and MKL dispatch to (AVX-512, AVX2, none): a test that pins FP8 numerics by accident
passes where it is written and fails on another host. Here tests/unit runs again in child processes as
an AVX2-only host and as a host without AVX would run it (ATen's kernel dispatch and MKL's code path
capped), so such a test fails where it is written. The golden trajectory pins its own code paths
(tests/e2e/test_golden.py).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HOSTS = {"avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
         "no_avx": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_unit_tests_hold_on(host, tmp_path):
    # an inductor cache of its own: torch 2.11 reuses a kernel generated for another ISA from a shared
    # cache and fails to build it (AVX-512 code under ATEN_CPU_CAPABILITY=default)
    env = {**os.environ, **HOSTS[host], "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    p = subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests/unit"), "-q", "-p", "no:cacheprovider",
                        "--tb=short"],  # short tracebacks: every failure's assertion fits in the message
                       cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert p.returncode == 0, f"tests/unit as an {host} host ({HOSTS[host]}):\n{p.stdout[-8000:]}"
