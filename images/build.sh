#!/usr/bin/env bash
# Builds the two container images with buildah, without a Docker engine or a base image:
#   perspective-worker:VERSION     entrypoint perspective-worker (run, migrate, ...)
#   perspective-operator:VERSION   entrypoint perspective-operator (run, crd)
# Each image is `scratch` plus the release binary and the shared libraries it links (from ldd),
# a passwd entry for the non-root user 65532 the chart and the operator's pods run as, and
# /tmp. Then each image is checked by running its entrypoint's --help in a chroot of the
# image's own filesystem, as that user.
#
#   images/build.sh                 # build, check, list
#   OCI_DIR=out images/build.sh     # also write out/perspective-{worker,operator}.tar (oci-archive,
#                                   # named localhost/NAME:VERSION, for `ctr images import`)
#   PROFILE=debug images/build.sh   # from the debug build (the e2e tests' real node; stripped)
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# buildah picks its storage driver (overlay where the kernel has it); STORAGE_DRIVER=vfs overrides.
target="${CARGO_TARGET_DIR:-$HOME/.cache/perspective-operator/target}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$root/Cargo.toml" | head -n1)"
say() { printf '[images] %s\n' "$*" >&2; }

command -v buildah >/dev/null || {
	say "installing buildah (apt-get)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah >/dev/null ||
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah >/dev/null; }
}

profile="${PROFILE:-release}"
case "$profile" in
release) profile_flag=--release ;;
debug) profile_flag= ;;
*) say "PROFILE must be release or debug, not '$profile'"; exit 2 ;;
esac
say "building $profile binaries"
# shellcheck disable=SC2086 # empty for debug
(cd "$root" && CARGO_TARGET_DIR="$target" cargo build $profile_flag -q -p perspective-worker -p perspective-operator)

build() { # name
	local name=$1 bin="$target/$profile/$1" ctr mnt lib
	say "$name:$version from scratch"
	ctr=$(buildah from scratch)
	mnt=$(buildah mount "$ctr")
	install -D -s -m 0755 "$bin" "$mnt/usr/local/bin/$name" # stripped: the release profile keeps debug info
	# The dynamic loader and every library the binary links, at the same paths.
	for lib in $(ldd "$bin" | grep -o '/[^ ]*'); do
		install -D -m 0755 "$(readlink -f "$lib")" "$mnt$lib" # the loader must be executable
	done
	mkdir -p "$mnt/etc" "$mnt/tmp"
	chmod 1777 "$mnt/tmp"
	printf 'root:x:0:0:root:/:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/:/sbin/nologin\n' >"$mnt/etc/passwd"
	printf 'root:x:0:\nnonroot:x:65532:\n' >"$mnt/etc/group"
	buildah umount "$ctr" >/dev/null
	buildah config \
		--entrypoint "[\"/usr/local/bin/$name\"]" --cmd '["--help"]' \
		--env PATH=/usr/local/bin --user 65532:65532 --workingdir / \
		--label org.opencontainers.image.title="$name" \
		--label org.opencontainers.image.version="$version" "$ctr"
	buildah commit -q --rm "$ctr" "localhost/$name:$version" >/dev/null
}

check() { # name: run the entrypoint inside the image's filesystem, as the image's user
	local name=$1 ctr mnt
	ctr=$(buildah from "localhost/$name:$version")
	mnt=$(buildah mount "$ctr")
	if ! chroot --userspec=65532:65532 "$mnt" "/usr/local/bin/$name" --help >/dev/null; then
		buildah umount "$ctr" >/dev/null; buildah rm "$ctr" >/dev/null
		say "FAILED: $name --help does not run inside its image"
		exit 1
	fi
	buildah umount "$ctr" >/dev/null
	buildah rm "$ctr" >/dev/null
	say "$name:$version runs in a chroot of its image as 65532"
}

for name in perspective-worker perspective-operator; do
	build "$name"
	check "$name"
	if [ -n "${OCI_DIR:-}" ]; then
		mkdir -p "$OCI_DIR"
		rm -f "$OCI_DIR/$name.tar"
		buildah push -q "localhost/$name:$version" "oci-archive:$OCI_DIR/$name.tar:localhost/$name:$version"
		say "wrote $OCI_DIR/$name.tar"
	fi
done
# Earlier builds' layers, no longer tagged, would pile up in buildah's storage.
buildah rmi --prune >/dev/null 2>&1 || true
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'perspective-(worker|operator)'
