#!/usr/bin/env bash
# Smoke test of the e2e harness: build the binaries, start the loopback
# control plane in a temp dir, and prove the parts the operator's e2e tests
# need actually work (CRDs with server-side apply, Jobs completing through
# kwok, StatefulSet rollout, garbage collection, helm). Stops everything on
# exit; exits non-zero on the first failure, keeping the temp dir's logs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
t0=$SECONDS
passed=0
current=""

say() { printf '[smoke] %s\n' "$*" >&2; }

# check NAME COMMAND...: run one step; the first failure ends the test.
check() {
	current="$1"
	shift
	local t=$SECONDS
	"$@"
	passed=$((passed + 1))
	say "ok   $current ($((SECONDS - t))s)"
}

work="$(mktemp -d "${TMPDIR:-/tmp}/perspective-e2e-smoke.XXXXXX")"

finish() {
	local rc=$?
	trap - EXIT
	"$here/control-plane.sh" stop "$work" || rc=1
	# Nothing of ours may survive: every process we start has $work in its args.
	local p left=""
	for p in /proc/[0-9]*; do
		if [[ "$(tr '\0' ' ' 2>/dev/null <"$p/cmdline")" == *"$work/"* ]]; then left+="${p#/proc/} "; fi
	done
	if [[ -n "$left" ]]; then
		say "leftover processes after stop: $left"
		rc=1
	fi
	if ((rc == 0)); then
		rm -rf "$work"
		say "passed in $((SECONDS - t0))s"
		echo "smoke: $passed passed, 0 failed"
	else
		say "FAILED at: ${current:-setup}; logs kept in $work/logs"
		echo "smoke: $passed passed, 1 failed"
	fi
	exit "$rc"
}
trap finish EXIT

current="build-bins.sh"
bin="$("$here/build-bins.sh" | tail -n1)"
current="control plane start"
E2E_BIN_DIR="$bin" "$here/control-plane.sh" start "$work"
eval "$("$here/control-plane.sh" env "$work")"
# helm keeps its state in the test dir, never in $HOME.
export HELM_CACHE_HOME="$work/helm/cache" HELM_CONFIG_HOME="$work/helm/config" HELM_DATA_HOME="$work/helm/data"
k8s_version="$(basename "$(dirname "$bin")")"

versions() {
	kube-apiserver --version | grep -qx "Kubernetes $k8s_version"
	local v
	v="$(kubectl version -o json)"
	[[ "$v" == *"\"gitVersion\": \"$k8s_version\""* ]]
	etcd --version | head -n1 >&2
}

namespace() {
	kubectl create namespace smoke
	# Pods are refused until the serviceaccount controller made "default".
	kubectl -n smoke wait --for=create serviceaccount/default --timeout=60s
}

crd() {
	kubectl apply --server-side -f - <<-'EOF'
		apiVersion: apiextensions.k8s.io/v1
		kind: CustomResourceDefinition
		metadata:
		  name: widgets.smoke.perspective.test
		spec:
		  group: smoke.perspective.test
		  scope: Namespaced
		  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
		  versions:
		  - name: v1
		    served: true
		    storage: true
		    subresources: {status: {}}
		    schema:
		      openAPIV3Schema:
		        type: object
		        properties:
		          spec:
		            type: object
		            required: [size]
		            properties:
		              size: {type: integer, minimum: 1}
		          status:
		            type: object
		            x-kubernetes-preserve-unknown-fields: true
	EOF
	kubectl wait --for=condition=Established crd/widgets.smoke.perspective.test --timeout=60s
	printf 'apiVersion: smoke.perspective.test/v1\nkind: Widget\nmetadata: {name: w1, namespace: smoke}\nspec: {size: 3}\n' |
		kubectl apply --server-side --field-manager=smoke -f -
	[[ "$(kubectl -n smoke get widget w1 -o jsonpath='{.spec.size}')" == 3 ]]
	# The schema is enforced: size 0 is rejected.
	! printf 'apiVersion: smoke.perspective.test/v1\nkind: Widget\nmetadata: {name: w2, namespace: smoke}\nspec: {size: 0}\n' |
		kubectl apply --server-side --field-manager=smoke -f - 2>/dev/null
}

job() {
	# The image is never pulled: kwok marks the pod Running, then (pod owned
	# by a Job) Succeeded, and the Job controller completes the Job.
	kubectl apply -f - <<-'EOF'
		apiVersion: batch/v1
		kind: Job
		metadata: {name: smoke-job, namespace: smoke}
		spec:
		  backoffLimit: 0
		  template:
		    spec:
		      restartPolicy: Never
		      containers:
		      - {name: main, image: example.invalid/never-pulled:1, command: ["true"]}
	EOF
	kubectl -n smoke wait --for=condition=complete job/smoke-job --timeout=90s
}

statefulset() {
	kubectl apply -f - <<-'EOF'
		apiVersion: apps/v1
		kind: StatefulSet
		metadata: {name: smoke-sts, namespace: smoke}
		spec:
		  replicas: 3
		  serviceName: smoke-sts
		  selector: {matchLabels: {app: smoke-sts}}
		  template:
		    metadata: {labels: {app: smoke-sts}}
		    spec:
		      containers:
		      - {name: main, image: example.invalid/never-pulled:1}
	EOF
	kubectl -n smoke rollout status statefulset/smoke-sts --timeout=120s
	[[ "$(kubectl -n smoke get statefulset smoke-sts -o jsonpath='{.status.readyReplicas}')" == 3 ]]
	local phases ips
	phases="$(kubectl -n smoke get pods -l app=smoke-sts -o jsonpath='{.items[*].status.phase}')"
	[[ "$phases" == "Running Running Running" ]]
	# Fake pod IPs come from kwok's loopback CIDR (see control-plane.sh).
	ips="$(kubectl -n smoke get pods -l app=smoke-sts -o jsonpath='{.items[*].status.podIP}')"
	say "pods Running on $(kubectl -n smoke get pods -l app=smoke-sts -o jsonpath='{.items[*].spec.nodeName}'), IPs $ips"
	if [[ -z "${E2E_POD_CIDR:-}" ]]; then
		for ip in $ips; do [[ "$ip" == 127.* ]]; done
	fi
}

garbage_collection() {
	# The pods are dependents of the StatefulSet (ownerReferences)...
	[[ "$(kubectl -n smoke get pods -l app=smoke-sts -o jsonpath='{.items[*].metadata.ownerReferences[0].kind}')" == "StatefulSet StatefulSet StatefulSet" ]]
	kubectl -n smoke delete statefulset smoke-sts --cascade=background --wait=true
	# The pods are deleted by the garbage collector (owner gone), and removed
	# by kwok's pod-delete stage in place of a kubelet.
	kubectl -n smoke wait --for=delete pod -l app=smoke-sts --timeout=60s
	[[ -z "$(kubectl -n smoke get pods -l app=smoke-sts -o name)" ]]
}

helm_works() {
	helm version --short
	local chart="$work/chart"
	mkdir -p "$chart/templates"
	printf 'apiVersion: v2\nname: smoke\nversion: 0.1.0\n' >"$chart/Chart.yaml"
	printf 'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: "{{ .Release.Name }}-cm"}\ndata: {hello: world}\n' >"$chart/templates/cm.yaml"
	helm install smoke-release "$chart" -n smoke --wait --timeout 60s
	[[ "$(kubectl -n smoke get configmap smoke-release-cm -o jsonpath='{.data.hello}')" == world ]]
	helm uninstall smoke-release -n smoke --wait
}

check "versions ($k8s_version)" versions
check "namespace + default serviceaccount" namespace
check "CRD server-side apply + schema validation" crd
check "Job completes via kwok" job
check "StatefulSet 3/3 Ready" statefulset
check "garbage collection of StatefulSet pods" garbage_collection
check "helm version + install" helm_works
current="control plane stop"
