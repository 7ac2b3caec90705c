import os

os.environ.setdefault("SCHEDKIT_DISABLE_PLUGIN_AUTOLOAD", "1")
