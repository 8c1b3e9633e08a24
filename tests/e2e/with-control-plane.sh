#!/usr/bin/env bash
# Run a command against a fresh loopback control plane, then tear it down.
#
#   tests/e2e/with-control-plane.sh CMD [ARG...]
#   tests/e2e/with-control-plane.sh --real-node CMD [ARG...]
#   tests/pg/pg.sh with tests/e2e/with-control-plane.sh cargo test --workspace
#
# --real-node: no kwok nodes; instead a real kubelet node (node.sh: containerd, runc, CNI
# bridge) with the worker and operator images (images.sh, cached by input hash) imported, and
# E2E_NODE_NAME, E2E_NODE_IP, E2E_NODE_SUBNET, E2E_NODE_DIR exported for CMD. The node is
# stopped before the control plane, and a leftover (process, mount, cgroup, bridge, sysctl...)
# fails the run.
#
# Builds the binaries if needed (build-bins.sh), starts control-plane.sh in a
# new temp dir with kwok stages WITHOUT `pod-complete` (Job pods stay Running
# until the test's pod runner patches them Succeeded/Failed), and runs CMD with
#   KUBECONFIG  the control plane's admin kubeconfig
#   PATH        the bin dir (kubectl, helm, ...) first
#   E2E_DIR     the control-plane dir (logs/, ports.env, ...; put pod logs under it)
# Afterwards, whatever CMD did (also on ^C): stops the control plane, kills
# stray pod-runner processes of this run, removes the dir, and exits with
# CMD's status. E2E_KEEP_DIR=1 keeps the dir (its path is printed).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
say() { printf '[with-control-plane] %s\n' "$*" >&2; }
die() {
	printf 'with-control-plane.sh: ERROR: %s\n' "$*" >&2
	exit 1
}
real_node=0
if [[ "${1:-}" == --real-node ]]; then
	real_node=1
	shift
fi
(($# > 0)) || die "usage: $0 [--real-node] CMD [ARG...]"

t0=$SECONDS
dir=""

# Processes started by the tests' pod runner carry E2E_POD_RUNNER_LOG_DIR
# (a dir under E2E_DIR) in their environment; a test binary that was killed
# or panicked past its cleanup may leave them behind.
# shellcheck disable=SC2317 # only called from the EXIT trap
stray_pod_processes() {
	local p
	for p in /proc/[0-9]*; do
		if tr '\0' '\n' 2>/dev/null <"$p/environ" | grep -qF "E2E_POD_RUNNER_LOG_DIR=$dir/"; then
			echo "${p#/proc/}"
		fi
	done
}

# shellcheck disable=SC2317 # the EXIT trap
cleanup() {
	local rc=$? t=$SECONDS left
	trap - EXIT INT TERM
	if [[ -n "$dir" ]]; then
		left="$(stray_pod_processes | tr '\n' ' ')"
		if [[ -n "$left" ]]; then
			say "killing stray pod-runner processes: $left"
			# shellcheck disable=SC2086
			kill -KILL $left 2>/dev/null || true
		fi
		if ((real_node)) && [[ -d "$dir/node" ]]; then
			"$here/node.sh" stop "$dir/node" || rc=1
		fi
		"$here/control-plane.sh" stop "$dir" || rc=1
		if [[ "${E2E_KEEP_DIR:-0}" == 1 ]]; then
			say "kept $dir"
		else
			rm -rf "$dir"
		fi
		say "control plane stopped in $((SECONDS - t))s"
	fi
	say "done in $((SECONDS - t0))s, exit status $rc"
	exit "$rc"
}
trap cleanup EXIT
# A signal ends the script through the EXIT trap, with the usual 128+N status.
trap 'exit 130' INT
trap 'exit 143' TERM

t=$SECONDS
say "building the e2e binaries if needed (build-bins.sh) ..."
bin="$("$here/build-bins.sh" | tail -n1)"
[[ -f "$bin/kwok-stages.yaml" ]] || die "$bin/kwok-stages.yaml missing (build-bins.sh writes it)"
say "binaries ready in $((SECONDS - t))s: $bin"

dir="$(mktemp -d "${TMPDIR:-/tmp}/perspective-e2e.XXXXXX")"

# kwok's default stages minus the `pod-complete` document: split on the YAML
# document separator and drop the Stage named pod-complete.
stages="$dir/kwok-stages-no-complete.yaml"
awk '
	function flush() { if (doc != "" && doc !~ /\n  name: pod-complete\n/) printf "%s", doc; doc = "" }
	/^---$/ { flush(); doc = $0 "\n"; next }
	{ doc = doc $0 "\n" }
	END { flush() }
' "$bin/kwok-stages.yaml" >"$stages"
grep -q '^  name: pod-complete$' "$stages" && die "could not drop pod-complete from $bin/kwok-stages.yaml"
if ! grep -q '^  name: pod-ready$' "$stages" || ! grep -q '^  name: pod-delete$' "$stages"; then
	die "unexpected kwok-stages.yaml layout: pod-ready/pod-delete missing after filtering ($stages)"
fi

if ((real_node)); then
	t=$SECONDS
	images="$("$here/images.sh" | tail -n1)"
	say "images ready in $((SECONDS - t))s: $images"
	export E2E_NODES=0 E2E_APISERVER_IPS
	E2E_APISERVER_IPS="$("$here/node.sh" address)"
fi

t=$SECONDS
say "starting the control plane in $dir ..."
E2E_BIN_DIR="$bin" E2E_KWOK_STAGES="$stages" "$here/control-plane.sh" start "$dir"
say "control plane up in $((SECONDS - t))s"

eval "$("$here/control-plane.sh" env "$dir")"
if ((real_node)); then
	t=$SECONDS
	E2E_BIN_DIR="$bin" "$here/node.sh" start "$dir/node" "$dir/kubeconfig"
	"$here/node.sh" import "$dir/node" "$images"/perspective-worker.tar "$images"/perspective-operator.tar
	eval "$("$here/node.sh" env "$dir/node")"
	say "real node up in $((SECONDS - t))s"
fi
export E2E_DIR="$dir"
# helm keeps its state in the test dir, never in $HOME.
export HELM_CACHE_HOME="$dir/helm/cache" HELM_CONFIG_HOME="$dir/helm/config" HELM_DATA_HOME="$dir/helm/data"

t=$SECONDS
say "running: $*"
rc=0
"$@" || rc=$?
say "command exited with status $rc after $((SECONDS - t))s"
exit "$rc"
