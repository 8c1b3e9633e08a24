#!/usr/bin/env bash
# A real Kubernetes control plane on loopback for the e2e tests:
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok
# (fake nodes; kwok plays the kubelet by writing pod status).
#
#   tests/e2e/control-plane.sh start DIR   # start, wait until usable, 2 Ready nodes
#   tests/e2e/control-plane.sh env DIR     # eval "$(... env DIR)": KUBECONFIG, PATH
#   tests/e2e/control-plane.sh stop DIR    # stop everything; safe to repeat
#
# DIR holds all state: kubeconfig, ports.env, pki/, etcd/, logs/<name>.log,
# pids/<name>.pid. Binaries come from build-bins.sh (or E2E_BIN_DIR).
#
# Network rules: everything listens on 127.0.0.1 only. Pods are fake; kwok
# gives them IPs from E2E_POD_CIDR, a loopback range by default, and the
# nodes the InternalIP 127.0.0.1, so even a stray dial of a pod or node
# address stays on this machine. Tests must still never dial pod IPs.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok)
timeout_s="${E2E_START_TIMEOUT:-120}"
# Controllers the operator's e2e tests rely on (names as of Kubernetes 1.36;
# the short pre-1.28 aliases still work). Node lifecycle is off on purpose:
# kwok nodes have no kubelet, so nothing would ever taint them.
kcm_controllers="${E2E_KCM_CONTROLLERS:-statefulset-controller,job-controller,garbage-collector-controller,namespace-controller,serviceaccount-controller,serviceaccount-token-controller,replicaset-controller,deployment-controller,disruption-controller,root-ca-certificate-publisher-controller,ttl-after-finished-controller}"
pod_cidr="${E2E_POD_CIDR:-127.64.0.0/16}"
# kwok Stage set; default: kwokctl's (build-bins.sh writes it next to the
# binaries). A harness that decides itself when a Job pod ends can pass a
# copy without the pod-complete stage and patch pod status instead.
kwok_stages="${E2E_KWOK_STAGES:-}"
nodes="${E2E_NODES:-2}"

usage() {
	echo "usage: $0 start|stop|env DIR" >&2
	exit 2
}
say() { printf '[control-plane] %s\n' "$*" >&2; }
die() {
	printf 'control-plane.sh: ERROR: %s\n' "$*" >&2
	exit 1
}

# --- process bookkeeping --------------------------------------------------

pid_alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

# Every process we start has DIR in its arguments and a binary of ours as
# argv[0]; this finds them even if a pid file was lost.
pids_of_dir() {
	local p args
	for p in /proc/[0-9]*; do
		args="$(tr '\0' ' ' 2>/dev/null <"$p/cmdline")" || continue
		case "$args" in
		*/etcd\ *"$dir/"* | */kube-apiserver\ *"$dir/"* | */kube-controller-manager\ *"$dir/"* | */kube-scheduler\ *"$dir/"* | */kwok\ *"$dir/"*)
			echo "${p#/proc/}"
			;;
		esac
	done
}

# Start NAME ARGS... detached: setsid gives each its own session/process
# group (so the caller's shell ending or ^C does not leave half a cluster),
# logs go to DIR/logs, the pid (== process group id) to DIR/pids.
launch() {
	local name="$1"
	shift
	setsid "$@" >"$dir/logs/$name.log" 2>&1 </dev/null &
	echo "$!" >"$dir/pids/$name.pid"
	# Not a job of this shell: no "Killed" notices if stop runs in it.
	disown "$!"
}

show_logs() {
	local name
	for name in "${components[@]}"; do
		[[ -f "$dir/logs/$name.log" ]] || continue
		echo "----- last lines of $dir/logs/$name.log -----" >&2
		tail -n 25 "$dir/logs/$name.log" >&2
	done
}

# wait_for DESCRIPTION COMPONENT COMMAND...: poll COMMAND until it succeeds;
# fail fast if COMPONENT's process died, fail after timeout_s.
wait_for() {
	local what="$1" name="$2" deadline=$((SECONDS + timeout_s))
	shift 2
	until "$@" >/dev/null 2>&1; do
		pid_alive "$(cat "$dir/pids/$name.pid")" || die "$name exited while waiting for $what (log: $dir/logs/$name.log)"
		((SECONDS < deadline)) || die "timed out after ${timeout_s}s waiting for $what"
		sleep 0.3
	done
}

tcp_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
https_ok() { [[ "$(curl -sk --max-time 2 "https://127.0.0.1:$1$2")" == ok ]]; }

# Free TCP ports on 127.0.0.1, picked below the kernel's ephemeral range so
# outgoing connections cannot take them between the check and the bind.
free_ports() {
	local n="$1" used p picked=()
	used=" $(ss -Htan | awk '{n=split($4,a,":"); print a[n]}' | sort -u | tr '\n' ' ') "
	while ((${#picked[@]} < n)); do
		p=$((20000 + RANDOM % 12000))
		[[ "$used" == *" $p "* ]] && continue
		used+="$p "
		picked+=("$p")
	done
	echo "${picked[@]}"
}

# --- commands ---------------------------------------------------------------

# terminate PID...: TERM their process groups, wait up to 15s, then KILL.
terminate() {
	local pid deadline=$((SECONDS + 15))
	for pid in "$@"; do
		kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
	done
	for pid in "$@"; do
		while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
		if pid_alive "$pid"; then
			say "pid $pid did not stop on TERM within 15s; killing"
			kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
		fi
	done
}

# Pid of component NAME if it is still our process (pids get reused).
component_pid() {
	local pid
	pid="$(cat "$dir/pids/$1.pid" 2>/dev/null || true)"
	pid_alive "$pid" || return 0
	[[ "$(tr '\0' ' ' 2>/dev/null <"/proc/$pid/cmdline")" == *"$dir/"* ]] && echo "$pid"
	return 0
}

cmd_stop() {
	[[ -d "$dir" ]] || return 0
	local name pid first=() last n
	# etcd goes last, after the apiserver has exited: an apiserver that
	# loses etcd while still starting hangs in its shutdown.
	for name in kwok kube-scheduler kube-controller-manager kube-apiserver; do
		pid="$(component_pid "$name")"
		[[ -z "$pid" ]] || first+=("$pid")
	done
	last="$(component_pid etcd)"
	n=${#first[@]}
	((n == 0)) || terminate "${first[@]}"
	if [[ -n "$last" ]]; then
		terminate "$last"
		n=$((n + 1))
	fi
	rm -f "$dir"/pids/*.pid
	# Anything else of ours (lost pid file, a half-finished start).
	local rest=()
	mapfile -t rest < <(pids_of_dir)
	if ((${#rest[@]})); then
		terminate "${rest[@]}"
		n=$((n + ${#rest[@]}))
	fi
	sleep 0.1
	[[ -z "$(pids_of_dir)" ]] || die "processes of $dir still running: $(pids_of_dir | tr '\n' ' ')"
	((n == 0)) || say "stopped ($n processes)"
}

cmd_env() {
	[[ -f "$dir/kubeconfig" && -f "$dir/bindir" ]] || die "no control plane state in $dir (run: $0 start $dir)"
	printf 'export KUBECONFIG=%q\n' "$dir/kubeconfig"
	# $PATH stays literal: it is expanded by the caller's eval.
	# shellcheck disable=SC2016
	printf 'export PATH=%q:"$PATH"\n' "$(cat "$dir/bindir")"
}

cmd_start() {
	local bin t0=$SECONDS
	mkdir -p "$dir"/{pki,etcd,logs,pids}
	chmod 700 "$dir/pki" "$dir/etcd"
	[[ -z "$(pids_of_dir)" ]] || die "a control plane is already running in $dir (stop it first)"
	for t in curl openssl ss setsid; do command -v "$t" >/dev/null || die "'$t' is needed"; done

	bin="${E2E_BIN_DIR:-$("$here/build-bins.sh" | tail -n1)}"
	for t in etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok; do
		[[ -x "$bin/$t" ]] || die "$bin/$t missing (run tests/e2e/build-bins.sh)"
	done
	kwok_stages="${kwok_stages:-$bin/kwok-stages.yaml}"
	[[ -f "$kwok_stages" ]] || die "$kwok_stages missing (run tests/e2e/build-bins.sh)"
	echo "$bin" >"$dir/bindir"

	# On any failure below: show the logs, leave nothing running.
	trap 'rc=$?; if ((rc)); then show_logs; cmd_stop || true; fi' EXIT

	local etcd_port etcd_peer api_port kcm_port sched_port kwok_port
	read -r etcd_port etcd_peer api_port kcm_port sched_port kwok_port < <(free_ports 6)
	cat >"$dir/ports.env" <<-EOF
		ETCD_PORT=$etcd_port
		APISERVER_PORT=$api_port
		KCM_PORT=$kcm_port
		SCHEDULER_PORT=$sched_port
		KWOK_PORT=$kwok_port
	EOF

	# Credentials: a static admin token (group system:masters) and the
	# service-account signing key pair.
	local token
	token="$(openssl rand -hex 24)"
	echo "$token,admin,admin,system:masters" >"$dir/pki/tokens.csv"
	openssl genrsa -out "$dir/pki/sa.key" 2048 2>/dev/null
	openssl rsa -in "$dir/pki/sa.key" -pubout -out "$dir/pki/sa.pub" 2>/dev/null
	chmod 600 "$dir/pki/tokens.csv" "$dir/pki/sa.key"

	# The API server's serving certificate, signed by a throwaway CA (pki/ca.crt, which
	# kubeconfig, controllers and pods trust): valid for 127.0.0.1, the Service IP
	# 10.0.0.1 and E2E_APISERVER_IPS (space-separated; a real node's pods reach the API
	# server through a port forwarded on their bridge gateway).
	local sans="IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes.default.svc" ip
	for ip in ${E2E_APISERVER_IPS:-}; do sans+=",IP:$ip"; done
	openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=e2e-ca \
		-keyout "$dir/pki/ca.key" -out "$dir/pki/ca.crt" 2>/dev/null
	openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
		-keyout "$dir/pki/apiserver.key" -out "$dir/pki/apiserver.csr" 2>/dev/null
	openssl x509 -req -in "$dir/pki/apiserver.csr" -CA "$dir/pki/ca.crt" -CAkey "$dir/pki/ca.key" \
		-CAcreateserial -days 2 -extfile <(printf 'subjectAltName=%s\n' "$sans") \
		-out "$dir/pki/apiserver.crt" 2>/dev/null
	chmod 600 "$dir/pki/ca.key" "$dir/pki/apiserver.key"
	cat >"$dir/kubeconfig" <<-EOF
		apiVersion: v1
		kind: Config
		clusters:
		- name: e2e
		  cluster:
		    server: https://127.0.0.1:$api_port
		    certificate-authority: $dir/pki/ca.crt
		users:
		- name: admin
		  user:
		    token: $token
		contexts:
		- name: e2e
		  context: {cluster: e2e, user: admin}
		current-context: e2e
	EOF
	chmod 600 "$dir/kubeconfig"
	local kc="$dir/kubeconfig"

	# etcd: throwaway data, so fsync is skipped (much faster on a slow disk).
	launch etcd "$bin/etcd" --name=e2e --data-dir="$dir/etcd" \
		--listen-client-urls="http://127.0.0.1:$etcd_port" --advertise-client-urls="http://127.0.0.1:$etcd_port" \
		--listen-peer-urls="http://127.0.0.1:$etcd_peer" --initial-advertise-peer-urls="http://127.0.0.1:$etcd_peer" \
		--initial-cluster="e2e=http://127.0.0.1:$etcd_peer" --unsafe-no-fsync --log-level=warn
	wait_for "etcd on :$etcd_port" etcd curl -sf --max-time 2 "http://127.0.0.1:$etcd_port/health"

	# The service CIDR is bookkeeping only: no kube-proxy, nothing dials it.
	# TaintNodesByCondition is off: it puts node.kubernetes.io/not-ready on
	# every new Node, and only the node-lifecycle controller (not run: no
	# kubelets) would take it off again; kwok nodes must stay schedulable.
	# No endpoint reconciler: it would publish 127.0.0.1 as the endpoint of
	# the "kubernetes" Service, which validation rejects (loopback), every 10s.
	launch kube-apiserver "$bin/kube-apiserver" \
		--etcd-servers="http://127.0.0.1:$etcd_port" \
		--bind-address=127.0.0.1 --advertise-address=127.0.0.1 --secure-port="$api_port" \
		--tls-cert-file="$dir/pki/apiserver.crt" --tls-private-key-file="$dir/pki/apiserver.key" \
		--kubelet-preferred-address-types=InternalIP \
		--token-auth-file="$dir/pki/tokens.csv" \
		--authorization-mode=RBAC \
		--service-cluster-ip-range=10.0.0.0/24 \
		--service-account-issuer=https://kubernetes.default.svc.cluster.local \
		--service-account-key-file="$dir/pki/sa.pub" \
		--service-account-signing-key-file="$dir/pki/sa.key" \
		--allow-privileged=true --profiling=false \
		--endpoint-reconciler-type=none \
		--disable-admission-plugins=TaintNodesByCondition
	wait_for "kube-apiserver /readyz on :$api_port" kube-apiserver https_ok "$api_port" /readyz
	say "kube-apiserver ready after $((SECONDS - t0))s"

	# No --authentication-kubeconfig for the controller manager and scheduler:
	# with token auth only, the apiserver publishes no client CA
	# (extension-apiserver-authentication), and the delegated authenticator
	# would log that every few seconds. Their /healthz is always allowed.
	launch kube-controller-manager "$bin/kube-controller-manager" \
		--kubeconfig="$kc" \
		--bind-address=127.0.0.1 --secure-port="$kcm_port" \
		--leader-elect=false --controllers="$kcm_controllers" \
		--service-account-private-key-file="$dir/pki/sa.key" \
		--root-ca-file="$dir/pki/ca.crt" --profiling=false

	launch kube-scheduler "$bin/kube-scheduler" \
		--kubeconfig="$kc" \
		--bind-address=127.0.0.1 --secure-port="$sched_port" \
		--leader-elect=false --profiling=false

	# kwok runs standalone: it has no built-in stages, so it gets the same
	# default set kwokctl would use (build-bins.sh extracts them from the
	# kwok module). It manages only nodes with the annotation below; its
	# kubelet-like server and the node addresses are on loopback. Node
	# heartbeats are Leases renewed every 10s, as kwokctl sets it up (the
	# heartbeat-with-lease stage expects that).
	launch kwok "$bin/kwok" --config="$kwok_stages" --kubeconfig="$kc" \
		--manage-all-nodes=false --manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake \
		--node-ip=127.0.0.1 --node-port="$kwok_port" --server-address="127.0.0.1:$kwok_port" \
		--cidr="$pod_cidr" --node-lease-duration-seconds=40

	wait_for "kube-controller-manager /healthz" kube-controller-manager https_ok "$kcm_port" /healthz
	wait_for "kube-scheduler /healthz" kube-scheduler https_ok "$sched_port" /healthz
	wait_for "kwok /healthz" kwok curl -sf --max-time 2 "http://127.0.0.1:$kwok_port/healthz"

	# kwok's documented fake node, minus its NoSchedule taint so that
	# ordinary pods schedule onto it.
	local i
	((nodes > 0)) || {
		trap - EXIT
		say "up in $((SECONDS - t0))s: https://127.0.0.1:$api_port, no kwok nodes; state in $dir"
		return 0
	}
	for ((i = 0; i < nodes; i++)); do
		cat <<-EOF
			apiVersion: v1
			kind: Node
			metadata:
			  name: kwok-node-$i
			  annotations:
			    node.alpha.kubernetes.io/ttl: "0"
			    kwok.x-k8s.io/node: fake
			  labels:
			    beta.kubernetes.io/arch: amd64
			    beta.kubernetes.io/os: linux
			    kubernetes.io/arch: amd64
			    kubernetes.io/hostname: kwok-node-$i
			    kubernetes.io/os: linux
			    kubernetes.io/role: agent
			    node-role.kubernetes.io/agent: ""
			    type: kwok
			spec: {}
			status:
			  allocatable: {cpu: "32", memory: 256Gi, pods: "110"}
			  capacity: {cpu: "32", memory: 256Gi, pods: "110"}
			---
		EOF
	done | "$bin/kubectl" --kubeconfig="$kc" apply -f - >"$dir/logs/nodes.log" 2>&1 ||
		die "creating the kwok nodes failed: $(cat "$dir/logs/nodes.log")"
	"$bin/kubectl" --kubeconfig="$kc" wait --for=condition=Ready node --all --timeout="${timeout_s}s" >>"$dir/logs/nodes.log" 2>&1 ||
		die "kwok nodes did not become Ready: $(cat "$dir/logs/nodes.log")"
	local taints
	taints="$("$bin/kubectl" --kubeconfig="$kc" get nodes -o jsonpath='{.items[*].spec.taints}')"
	[[ -z "$taints" ]] || die "kwok nodes carry taints, pods would not schedule: $taints"

	trap - EXIT
	say "up in $((SECONDS - t0))s: https://127.0.0.1:$api_port, $nodes kwok nodes Ready; state in $dir"
}

[[ $# -eq 2 ]] || usage
dir="$(realpath -m "$2")"
case "$1" in
start) cmd_start ;;
stop) cmd_stop ;;
env) cmd_env ;;
*) usage ;;
esac
