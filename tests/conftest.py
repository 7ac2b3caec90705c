import os

# Our own tests never pick up plugins that happen to be installed in the environment,
# except where a test switches them on explicitly.
os.environ.setdefault("SCHEDKIT_DISABLE_PLUGINS", "")
