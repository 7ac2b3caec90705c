"""A third-party router plugin installs and switches on like a policy: the example
package examples/plugins/schedkit-token-router, installed into a temporary folder as
tests/plugins/test_entry_points.py installs the policy example."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from schedkit import PluginError
from schedkit.cluster.router import Router
from schedkit.config import config_from_dict, load_config
from schedkit.plugins.manager import discover_plugins

from .test_entry_points import _can_build_wheels_offline, _install_by_hand, _install_with_pip

ROOT = Path(__file__).resolve().parents[2]
ROUTER_DIR = ROOT / "examples" / "plugins" / "schedkit-token-router"


@pytest.fixture(scope="module")
def router_site(tmp_path_factory):
    target = tmp_path_factory.mktemp("token-router") / "site"
    target.mkdir()
    if _can_build_wheels_offline():
        _install_with_pip(ROUTER_DIR, target)
    else:
        _install_by_hand(ROUTER_DIR, target)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
        mp.syspath_prepend(str(target))
        yield target
    for name in [m for m in sys.modules if m.startswith("schedkit_token_router")]:
        del sys.modules[name]


def test_the_installed_router_is_discovered_but_not_enabled(router_site):
    ep = discover_plugins()["least-tokens"]
    assert ep.dist is not None and ep.dist.name == "schedkit-token-router"
    r = Router(config_from_dict({"replicas": {"count": 2}}))
    assert r.plugin_manager.get_plugin("least-tokens") is None


def test_yaml_switches_the_router_on_with_settings(router_site, tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("replicas: {count: 2}\n"
                    "router:\n"
                    "  policy: least-tokens\n"
                    "  plugins:\n"
                    "    - name: least-tokens\n"
                    "      settings: {cached_discount: 0.5}\n")
    r = Router(load_config(path))
    plugin = r.plugin_manager.get_plugin("least-tokens")
    assert type(plugin).__module__ == "schedkit_token_router" and plugin.cached_discount == 0.5
    assert Path(sys.modules["schedkit_token_router"].__file__).is_relative_to(router_site)
    # One long prompt on 0, then short ones fill 1 until its tokens pass 0's.
    picks = [r.route(r.make_request(f"r{i}", [1] * n)).index for i, n in enumerate([400, 100, 100, 100, 100, 100])]
    assert picks == [0, 1, 1, 1, 1, 0]
    r.finished("r0")
    assert r.route(r.make_request("r6", [1] * 50)).index == 0


def test_bad_settings_of_an_installed_router_name_it(router_site):
    with pytest.raises(PluginError, match="'least-tokens'.*cached_discount"):
        Router(config_from_dict({"replicas": {"count": 2}, "router": {
            "policy": "least-tokens", "plugins": [{"name": "least-tokens", "settings": {"cached_discount": 2}}]}}))
