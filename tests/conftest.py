import os

# Our own tests never pick up plugins that happen to be installed in the environment,
# except where a test switches them on explicitly: third-party entry points are hidden
# (schedkit's bundled plugins are known without them), and a developer's blocklist does
# not leak in. A test that installs a plugin unsets the first variable for itself
# (monkeypatch.delenv), as tests/plugins/test_entry_points.py does.
os.environ["SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("SCHEDKIT_DISABLE_PLUGINS", None)
