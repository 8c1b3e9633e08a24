// The real node's sandbox ("pause") program: holds a pod's namespaces and
// does nothing else. Packed as localhost/pause by tests/e2e/node.sh.
module perspective.local/e2e-bins/pause

go 1.26.0
