#!/usr/bin/env bash
# The worker and operator images for the real node, as OCI archives, cached by input hash.
#
#   dir=$(tests/e2e/images.sh | tail -n1)   # dir with perspective-worker.tar, perspective-operator.tar
#
# Built from the debug binaries (the ones `cargo test` builds anyway) by images/build.sh with
# PROFILE=debug. The key is the hash of both binaries and of images/build.sh, so a warm run whose
# code did not change reuses the archives, and any change to the code rebuilds them.
# Cache: ${PERSPECTIVE_CACHE:-~/.cache/perspective-operator}/images/<hash>/ (older keys are
# removed, so it holds one set).
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
target="${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}"
cache="${PERSPECTIVE_CACHE:-$HOME/.cache/perspective-operator}/images"
say() { printf '[e2e-images] %s\n' "$*" >&2; }

(cd "$root" && CARGO_TARGET_DIR="$target" cargo build -q -p perspective-worker -p perspective-operator)
key="$(cat "$target/debug/perspective-worker" "$target/debug/perspective-operator" "$root/images/build.sh" |
	sha256sum | cut -c1-16)"
out="$cache/sets/$key"
if [[ -f "$out/perspective-worker.tar" && -f "$out/perspective-operator.tar" ]]; then
	say "images for input $key: cached"
else
	t=$SECONDS
	say "images for input $key: building (images/build.sh, PROFILE=debug) ..."
	mkdir -p "$cache/sets"
	rm -rf "$out.tmp"
	PROFILE=debug OCI_DIR="$out.tmp" CARGO_TARGET_DIR="$target" "$root/images/build.sh" >&2
	find "$cache/sets" -mindepth 1 -maxdepth 1 ! -name "$key.tmp" -exec rm -rf {} +
	mv "$out.tmp" "$out"
	say "built in $((SECONDS - t))s"
fi
echo "$out"
