#!/usr/bin/env bash
# Build the e2e toolchain (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kubelet, kwok, helm, promtool, and the real node's
# pause program) from published Go modules, through the
# Go module proxy only: the wrapper modules in bins/ pin every version.
#
#   tests/e2e/build-bins.sh            # progress on stderr, bin dir on stdout
#   BIN=$(tests/e2e/build-bins.sh | tail -n1)
#
# Idempotent: each binary has a stamp (module version, Go version, ldflags,
# hash of its wrapper go.mod/go.sum); a binary whose stamp matches is skipped,
# so a warm machine rebuilds nothing. Everything lives under
#   ${PERSPECTIVE_CACHE:-$HOME/.cache/perspective-operator}/
#     go/mod, go/build          GOMODCACHE and GOCACHE
#     k8s/<version>/bin         the binaries (+ .stamps/)
#     k8s/<version>/logs        one build log per binary
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
bins="$here/bins"
cache="${PERSPECTIVE_CACHE:-$HOME/.cache/perspective-operator}"

say() { printf '[build-bins] %s\n' "$*" >&2; }
die() {
	printf '\nbuild-bins.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

command -v go >/dev/null || die "no 'go' on PATH: the e2e binaries are built from Go modules (Go >= 1.26 needed)"

export GOMODCACHE="$cache/go/mod"
export GOCACHE="$cache/go/build"
# readonly: a go.sum that lacks an entry fails instead of being rewritten.
# buildvcs=false: the binaries must not depend on the state of this git tree.
export GOFLAGS="-mod=readonly -buildvcs=false"
# Static binaries, no C toolchain needed.
export CGO_ENABLED=0

# Version of a module as resolved by a wrapper module (reads only go.mod files).
modver() { (cd "$bins/$1" && go list -m -f '{{.Version}}' "$2") || die "cannot resolve $2 in bins/$1 (network to the Go proxy? go.mod edited?)"; }

k8s_version="$(modver kubernetes k8s.io/kubernetes)"
[[ "$k8s_version" =~ ^v1\.([0-9]+)\. ]] || die "unexpected k8s.io/kubernetes version '$k8s_version'"
k8s_minor="${BASH_REMATCH[1]}"
etcd_version="$(modver etcd go.etcd.io/etcd/server/v3)"
kwok_version="$(modver kwok sigs.k8s.io/kwok)"
helm_version="$(modver helm helm.sh/helm/v3)"
# Prometheus publishes 3.X.Y as the Go module tag v0.3XX.Y.
prometheus_version="$(modver prometheus github.com/prometheus/prometheus)"
# helm's Makefile derives its default Capabilities.KubeVersion from the
# client-go it is built with (v0.X -> 1.X); do the same.
helm_client_go="$(modver helm k8s.io/client-go)"
helm_kube_minor="$(cut -d. -f2 <<<"$helm_client_go")"

root="$cache/k8s/$k8s_version"
bindir="$root/bin"
mkdir -p "$bindir/.stamps" "$root/logs"

# Two builds at once (e.g. two test runs) must not race on the same files.
exec 9>"$root/.build.lock"
flock 9

# The same -X flags as Kubernetes' hack/lib/version.sh, so `--version` and
# /version report the real release instead of v0.0.0-master+$Format.
k8s_ldflags=""
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
	k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
	k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

# name | wrapper module (bins/<dir>) | main package | version | extra ldflags
# (etcd and kwok carry their version as a constant in the source.)
targets=(
	"etcd|etcd|go.etcd.io/etcd/server/v3|$etcd_version|"
	"kube-apiserver|kubernetes|k8s.io/kubernetes/cmd/kube-apiserver|$k8s_version|$k8s_ldflags"
	"kube-controller-manager|kubernetes|k8s.io/kubernetes/cmd/kube-controller-manager|$k8s_version|$k8s_ldflags"
	"kube-scheduler|kubernetes|k8s.io/kubernetes/cmd/kube-scheduler|$k8s_version|$k8s_ldflags"
	"kubectl|kubernetes|k8s.io/kubernetes/cmd/kubectl|$k8s_version|$k8s_ldflags"
	"kubelet|kubernetes|k8s.io/kubernetes/cmd/kubelet|$k8s_version|$k8s_ldflags"
	"pause|pause|perspective.local/e2e-bins/pause|v1|"
	"kwok|kwok|sigs.k8s.io/kwok/cmd/kwok|$kwok_version|"
	"helm|helm|helm.sh/helm/v3/cmd/helm|$helm_version| -X helm.sh/helm/v3/internal/version.version=$helm_version -X helm.sh/helm/v3/internal/version.gitTreeState=clean -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$helm_kube_minor -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$helm_kube_minor"
	"promtool|prometheus|github.com/prometheus/prometheus/cmd/promtool|$prometheus_version| -X github.com/prometheus/common/version.Version=$prometheus_version"
)

say "Kubernetes $k8s_version, etcd $etcd_version, kwok $kwok_version, helm $helm_version, prometheus $prometheus_version; $(go version)"
say "cache: $cache"
total_start=$SECONDS
built=0
for t in "${targets[@]}"; do
	IFS='|' read -r name dir pkg version extra <<<"$t"
	ldflags="-s -w$extra"
	# The toolchain that builds this module (GOTOOLCHAIN may switch per go line).
	go_version="$(cd "$bins/$dir" && go version)"
	stamp="$(printf '%s\n' "name=$name" "package=$pkg" "version=$version" "go=$go_version" \
		"ldflags=$ldflags" "go.mod=$(sha256sum <"$bins/$dir/go.mod" | cut -d' ' -f1)" \
		"go.sum=$(sha256sum <"$bins/$dir/go.sum" | cut -d' ' -f1)")"
	stampfile="$bindir/.stamps/$name"
	if [[ -x "$bindir/$name" && -f "$stampfile" && "$(cat "$stampfile")" == "$stamp" ]]; then
		say "$name $version: up to date, skipped"
		continue
	fi

	log="$root/logs/build-$name.log"
	say "$name $version: building (log: $log) ..."
	start=$SECONDS
	rm -f "$stampfile"
	# Build next to the target and rename: an interrupted build never leaves
	# a half-written binary that looks usable.
	if ! (cd "$bins/$dir" && nice -n 10 go build -trimpath -ldflags "$ldflags" -o "$bindir/.$name.tmp" "$pkg") >"$log" 2>&1; then
		tail -n 40 "$log" >&2
		die "building $name ($pkg $version) failed after $((SECONDS - start))s; full log: $log"
	fi
	mv -f "$bindir/.$name.tmp" "$bindir/$name"
	printf '%s\n' "$stamp" >"$stampfile"
	built=$((built + 1))
	say "$name $version: built in $((SECONDS - start))s ($(du -h "$bindir/$name" | cut -f1))"
done

# kwok run on its own (not through kwokctl) has no built-in stages and
# refuses to start without any. Write the default set kwokctl uses (fast
# node init + lease heartbeat, pod ready/complete/delete), read from the
# kwok module that was built, so stages and binary always match.
stages="$bindir/kwok-stages.yaml"
stages_header="# kwok $kwok_version default stages (generated by build-bins.sh)"
if [[ ! -f "$stages" || "$(head -n1 "$stages")" != "$stages_header" ]]; then
	kwok_dir="$(cd "$bins/kwok" && go mod download -json sigs.k8s.io/kwok | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	[[ -d "$kwok_dir/kustomize/stage" ]] || die "kwok module source not found (got '$kwok_dir')"
	{
		echo "$stages_header"
		for f in node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease \
			pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete; do
			echo "---"
			cat "$kwok_dir/kustomize/stage/$f.yaml" || die "kwok stage $f.yaml missing in $kwok_dir"
		done
	} >"$stages.tmp"
	mv -f "$stages.tmp" "$stages"
	say "kwok-stages.yaml written"
fi

# The Prometheus Operator's CRDs for ServiceMonitor, PodMonitor and PrometheusRule, so the
# chart's monitoring objects can be checked by a server-side dry-run (operator/tests/chart.rs).
# Read from its published Go module (the release bundle is generated from the same files).
prometheus_operator_version="v0.85.0"
monitoring_crds="$bindir/prometheus-operator-crds.yaml"
monitoring_crds_header="# prometheus-operator $prometheus_operator_version CRDs (generated by build-bins.sh)"
if [[ ! -f "$monitoring_crds" || "$(head -n1 "$monitoring_crds")" != "$monitoring_crds_header" ]]; then
	promop_dir="$(cd "$bins/prometheus" && go mod download -json "github.com/prometheus-operator/prometheus-operator@$prometheus_operator_version" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')"
	[[ -d "$promop_dir/example/prometheus-operator-crd" ]] || die "prometheus-operator module source not found (got '$promop_dir')"
	{
		echo "$monitoring_crds_header"
		for kind in servicemonitors podmonitors prometheusrules; do
			echo "---"
			cat "$promop_dir/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" || die "CRD $kind missing in $promop_dir"
		done
	} >"$monitoring_crds.tmp"
	mv -f "$monitoring_crds.tmp" "$monitoring_crds"
	say "prometheus-operator-crds.yaml written"
fi

say "${#targets[@]} binaries ready ($built built) in $((SECONDS - total_start))s"
echo "$bindir"
