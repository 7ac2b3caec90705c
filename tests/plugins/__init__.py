"""Plugin-layer tests (a package, so its module names cannot clash with other folders')."""
