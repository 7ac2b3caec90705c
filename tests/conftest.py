import os
import sys

import pytest

# Our own tests never pick up plugins that happen to be installed in the environment,
# except where a test switches them on explicitly: third-party entry points are hidden
# (schedkit's bundled plugins are known without them), and a developer's blocklist does
# not leak in. A test that installs a plugin unsets the first variable for itself
# (monkeypatch.delenv), as tests/plugins/test_entry_points.py does.
os.environ["SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("SCHEDKIT_DISABLE_PLUGINS", None)
# The CPU runner's float32 layers take the multi-row GEMM without the start-up probe that
# picks it or oneDNN on AVX-512 CPUs: a probe timed under a loaded test run would be kept
# beside the kernel library for later real runs (the probe's tests monkeypatch this away).
os.environ.setdefault("SCHEDKIT_CPU_GEMM", "1")


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """``install_plugin(module, source, {entry-point name: "module:Object"})``: a plugin
    package in a temporary site folder, visible to this process and to engine processes
    it starts, with installed plugins no longer hidden for this test."""

    def install(module: str, source: str, entry_points: dict[str, str]) -> None:
        site = tmp_path / "site"
        (site / module).mkdir(parents=True)
        (site / module / "__init__.py").write_text(source)
        dist = site / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (dist / "entry_points.txt").write_text(f"[schedkit]\n{lines}")
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.setenv("PYTHONPATH", f"{site}:{':'.join(p for p in sys.path if p)}")
        monkeypatch.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)

    return install
