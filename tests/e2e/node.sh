#!/usr/bin/env bash
# A real Kubernetes node for the e2e tests: kubelet + containerd + runc + the CNI bridge plugin,
# joined to a control plane started by control-plane.sh. Pods really run (as containers, from
# images imported into this node's containerd; there is no registry).
#
#   tests/e2e/node.sh start DIR KUBECONFIG   # install packages if missing, start, wait for Ready
#   tests/e2e/node.sh import DIR ARCHIVE...  # load docker-archive/oci-archive images (localhost/...)
#   tests/e2e/node.sh env DIR                # eval "$(...)": E2E_NODE_NAME, E2E_NODE_IP, ...
#   tests/e2e/node.sh stop DIR               # stop and clean everything; safe to repeat
#   tests/e2e/node.sh check DIR              # exit 1 naming any leftover (process, mount, cgroup,
#                                            # netns, bridge, sysctl, iptables chain, fixed path)
#   tests/e2e/node.sh address                # the node's IP (to put in the API server's cert)
#
# Everything lives under DIR (containerd root/state/socket, runc root, kubelet root, pod logs,
# CNI config and IPAM state), except what the kubelet and containerd write at fixed places:
# the pod cgroups (/sys/fs/cgroup/*/kubepods), network namespaces (/run/netns/cni-*), shim
# sockets (/run/containerd), /var/log/containers, /var/lib/kubelet, /var/lib/cni and the kernel
# settings the kubelet tunes. `start` records their state, `stop` puts it back, `check` proves it.
# So there is one real node per machine at a time (the bridge name is the lock).
#
# Network: the node's address is the gateway of a private bridge (E2E_NODE_SUBNET, default
# 10.213.0.0/24) with no route out: no masquerade, no default route in pods, and pods get a
# resolv.conf without nameservers, so no packet or DNS query leaves the machine. Pods reach
# host services (PostgreSQL, the API server) only where a test forwards a port on the gateway.
set -Eeuo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
node_name="${E2E_NODE_NAME:-real-node}"
bridge="${E2E_NODE_BRIDGE:-pdnode0}"
subnet="${E2E_NODE_SUBNET:-10.213.0.0/24}"
net_prefix="${subnet%.*}"          # 10.213.0
node_ip="$net_prefix.1"            # the bridge gateway
timeout_s="${E2E_START_TIMEOUT:-120}"
pause_image="localhost/pause:v1"
psql_image="localhost/e2e-psql:v1" # a reader for tests: psql and the libraries it links
service_ip=10.0.0.1                # the `kubernetes` Service (control-plane.sh's service CIDR)

# Kernel settings the kubelet (setupKernelTunables) and the bridge plugin change.
sysctls=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
	kernel.keys.root_maxkeys kernel.keys.root_maxbytes net.ipv4.ip_forward)
# Fixed paths written outside DIR; removed on stop unless they existed before start.
fixed_paths=(/var/log/containers /var/log/pods /var/lib/kubelet /var/lib/cni /run/containerd
	/run/netns /var/run/netns /etc/cni /opt/cni)

say() { printf '[node] %s\n' "$*" >&2; }
die() {
	printf 'node.sh: ERROR: %s\n' "$*" >&2
	exit 1
}
usage() {
	echo "usage: $0 start DIR KUBECONFIG | import DIR ARCHIVE... | env DIR | stop DIR | check DIR | address" >&2
	exit 2
}

pid_alive() { [[ -n "$1" ]] && kill -0 "$1" 2>/dev/null; }

# Processes of this node: the kubelet and containerd (DIR in their arguments) and the shims
# (containerd's socket, under DIR, in theirs).
node_pids() {
	local p args
	for p in /proc/[0-9]*; do
		args="$(tr '\0' ' ' 2>/dev/null <"$p/cmdline")" || continue
		case "$args" in
		*kubelet\ *"$dir/"* | *containerd\ *"$dir/"* | *containerd-shim*"$dir/"*) echo "${p#/proc/}" ;;
		esac
	done
}

# Processes inside the pod cgroups (the containers themselves).
pod_pids() {
	local f
	for f in /sys/fs/cgroup/pids/kubepods /sys/fs/cgroup/memory/kubepods /sys/fs/cgroup/cpu/kubepods; do
		[[ -d "$f" ]] && find "$f" -name cgroup.procs -exec cat {} + 2>/dev/null
	done | sort -u
	return 0
}

pod_cgroups() { find /sys/fs/cgroup -mindepth 2 -maxdepth 2 -type d -name 'kubepods*' 2>/dev/null || true; }
our_mounts() { awk -v d="$dir/" '$5 ~ "^" d || $5 ~ "^/run/netns/cni-" || $5 ~ "^/run/containerd/" || $5 ~ "^/var/lib/kubelet/" {print $5}' /proc/self/mountinfo; }

wait_for() { # DESCRIPTION PIDFILE COMMAND...
	local what="$1" pidfile="$2" deadline=$((SECONDS + timeout_s))
	shift 2
	until "$@" >/dev/null 2>&1; do
		pid_alive "$(cat "$pidfile" 2>/dev/null)" || die "$(basename "$pidfile" .pid) exited while waiting for $what (log: $dir/logs/$(basename "$pidfile" .pid).log)"
		((SECONDS < deadline)) || die "timed out after ${timeout_s}s waiting for $what"
		sleep 0.2
	done
}

free_port() {
	local used p
	used=" $(ss -Htan | awk '{n=split($4,a,":"); print a[n]}' | sort -u | tr '\n' ' ') "
	while :; do
		p=$((20000 + RANDOM % 12000))
		[[ "$used" == *" $p "* ]] || break
	done
	echo "$p"
}

# apt-get install, refreshing the package lists once if they are missing or stale.
apt_install() { # LOG PACKAGE...
	local log="$1"
	shift
	say "installing $* (apt-get)"
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$log" 2>&1 && return 0
	{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; } >>"$log" 2>&1 ||
		die "apt-get install $* failed: $(tail -n 5 "$log")"
}

ensure_packages() {
	local missing=()
	command -v containerd >/dev/null || missing+=(containerd)
	command -v runc >/dev/null || missing+=(runc)
	[[ -x /usr/lib/cni/bridge && -x /usr/lib/cni/host-local && -x /usr/lib/cni/loopback ]] || missing+=(containernetworking-plugins)
	command -v iptables-save >/dev/null || missing+=(iptables)
	command -v socat >/dev/null || missing+=(socat)
	((${#missing[@]} == 0)) || apt_install "$dir/logs/apt.log" "${missing[@]}"
}

iptables_kube_chains() {
	local t
	for t in filter nat mangle; do
		iptables -t "$t" -S 2>/dev/null | awk -v t="$t" '$1 == "-N" && $2 ~ /^KUBE-/ {print t, $2}'
		ip6tables -t "$t" -S 2>/dev/null | awk -v t="$t" '$1 == "-N" && $2 ~ /^KUBE-/ {print "6" t, $2}'
	done
	return 0
}

# --- start -------------------------------------------------------------------

cmd_start() {
	local kubeconfig="$1" bin t0=$SECONDS
	[[ -f "$kubeconfig" ]] || die "no kubeconfig at $kubeconfig"
	[[ "$(id -u)" == 0 ]] || die "a real node needs root (containers, cgroups, network namespaces)"
	ip link show "$bridge" >/dev/null 2>&1 && die "bridge $bridge exists: another real node runs on this machine (or a run was not cleaned: $0 stop DIR)"
	[[ -z "$(pod_cgroups)" ]] || die "pod cgroups of another node exist: $(pod_cgroups | tr '\n' ' ')"
	mkdir -p "$dir"/{logs,pids,containerd,kubelet,pod-logs,cni/net.d,cni/ipam,cni/cache,runc}
	ensure_packages
	bin="${E2E_BIN_DIR:-$("$here/build-bins.sh" | tail -n1)}"
	for t in kubelet pause kubectl; do [[ -x "$bin/$t" ]] || die "$bin/$t missing (run tests/e2e/build-bins.sh)"; done

	# What we must put back.
	: >"$dir/sysctl.saved"
	for s in "${sysctls[@]}"; do echo "$s=$(sysctl -n "$s")" >>"$dir/sysctl.saved"; done
	: >"$dir/paths.preexisting"
	for p in "${fixed_paths[@]}"; do [[ -e "$p" ]] && echo "$p" >>"$dir/paths.preexisting"; done
	iptables_kube_chains >"$dir/iptables.preexisting"
	echo "$kubeconfig" >"$dir/kubeconfig.path"
	echo "$bin" >"$dir/bindir"

	trap 'rc=$?; if ((rc)); then tail -n 30 "$dir"/logs/*.log >&2 || true; cmd_stop || true; fi' EXIT

	# The bridge, made before the kubelet so the node address exists; the CNI plugin adopts it.
	ip link add "$bridge" type bridge
	ip addr add "$node_ip/${subnet#*/}" dev "$bridge"
	ip link set "$bridge" up
	# In-cluster clients (the operator pod) dial the `kubernetes` Service, $service_ip:443.
	# There is no kube-proxy: the address lives on the bridge and socat forwards it to the
	# API server on loopback (its certificate names $service_ip).
	ip addr add "$service_ip/32" dev "$bridge"
	local api_port
	api_port="$(sed -n 's#^ *server: https://127.0.0.1:\([0-9]*\)$#\1#p' "$kubeconfig")"
	[[ -n "$api_port" ]] || die "no https://127.0.0.1:PORT server in $kubeconfig"
	setsid socat "TCP-LISTEN:443,bind=$service_ip,fork,reuseaddr" "TCP:127.0.0.1:$api_port" \
		>"$dir/logs/socat.log" 2>&1 </dev/null &
	echo "$!" >"$dir/pids/socat.pid"
	disown "$!"

	cat >"$dir/cni/net.d/10-e2e.conflist" <<-EOF
		{
		  "cniVersion": "0.4.0",
		  "name": "e2e",
		  "plugins": [
		    {
		      "type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false,
		      "hairpinMode": true,
		      "ipam": {"type": "host-local", "dataDir": "$dir/cni/ipam",
		               "ranges": [[{"subnet": "$subnet", "gateway": "$node_ip"}]],
		               "routes": [{"dst": "$service_ip/32"}]}
		    },
		    {"type": "loopback"}
		  ]
		}
	EOF
	# No nameserver: a pod that resolves a name fails at once instead of asking the world.
	printf 'search invalid\noptions ndots:0\n' >"$dir/resolv.conf"

	local sock="$dir/containerd.sock"
	cat >"$dir/containerd.toml" <<-EOF
		version = 2
		root = "$dir/containerd/root"
		state = "$dir/containerd/state"
		disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
		  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
		  "io.containerd.internal.v1.tracing", "io.containerd.tracing.processor.v1.otlp"]
		[grpc]
		  address = "$sock"
		[ttrpc]
		  address = "$sock.ttrpc"
		[debug]
		  address = "$sock.debug"
		[metrics]
		  address = ""
		[plugins."io.containerd.grpc.v1.cri"]
		  sandbox_image = "$pause_image"
		  disable_tcp_service = true
		  stream_server_address = "127.0.0.1"
		  stream_server_port = "0"
		  # Negative OOM scores need CAP_SYS_RESOURCE, which root lacks here.
		  restrict_oom_score_adj = true
		  disable_hugetlb_controller = true
		  tolerate_missing_hugetlb_controller = true
		  enable_selinux = false
		  [plugins."io.containerd.grpc.v1.cri".containerd]
		    snapshotter = "overlayfs"
		    default_runtime_name = "runc"
		    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
		      runtime_type = "io.containerd.runc.v2"
		      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
		        SystemdCgroup = false
		        Root = "$dir/runc"
		  [plugins."io.containerd.grpc.v1.cri".cni]
		    bin_dir = "/usr/lib/cni"
		    conf_dir = "$dir/cni/net.d"
		    max_conf_num = 1
	EOF
	setsid containerd --config "$dir/containerd.toml" >"$dir/logs/containerd.log" 2>&1 </dev/null &
	echo "$!" >"$dir/pids/containerd.pid"
	disown "$!"
	wait_for "containerd on $sock" "$dir/pids/containerd.pid" ctr -a "$sock" version

	cmd_import_pause "$bin"
	cmd_import_psql

	local kubelet_port healthz_port
	kubelet_port="$(free_port)"
	healthz_port="$(free_port)"
	cat >"$dir/kubelet.yaml" <<-EOF
		apiVersion: kubelet.config.k8s.io/v1beta1
		kind: KubeletConfiguration
		# Serves logs/exec to the API server on the node address only; the test cluster trusts it.
		address: $node_ip
		port: $kubelet_port
		readOnlyPort: 0
		healthzBindAddress: 127.0.0.1
		healthzPort: $healthz_port
		authentication:
		  anonymous: {enabled: true}
		  webhook: {enabled: false}
		authorization: {mode: AlwaysAllow}
		containerRuntimeEndpoint: unix://$sock
		cgroupDriver: cgroupfs
		failCgroupV1: false
		failSwapOn: false
		resolvConf: $dir/resolv.conf
		podLogsDir: $dir/pod-logs
		staticPodPath: ""
		# Fast feedback for the tests.
		syncFrequency: 5s
		nodeStatusUpdateFrequency: 2s
		nodeStatusReportFrequency: 10s
		fileCheckFrequency: 5s
		runtimeRequestTimeout: 60s
		serializeImagePulls: false
		# The disk is shared with build caches: never evict or garbage-collect images for it.
		evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
		imageGCHighThresholdPercent: 100
		imageGCLowThresholdPercent: 99
		imageMinimumGCAge: 24h
		maxPods: 60
		localStorageCapacityIsolation: false
	EOF
	setsid "$bin/kubelet" --config="$dir/kubelet.yaml" --kubeconfig="$kubeconfig" \
		--root-dir="$dir/kubelet" --cert-dir="$dir/kubelet/pki" \
		--hostname-override="$node_name" --node-ip="$node_ip" \
		--node-labels="perspective.e2e/real-node=true" --v=1 \
		>"$dir/logs/kubelet.log" 2>&1 </dev/null &
	echo "$!" >"$dir/pids/kubelet.pid"
	disown "$!"
	wait_for "kubelet /healthz" "$dir/pids/kubelet.pid" curl -sf --max-time 2 "http://127.0.0.1:$healthz_port/healthz"
	wait_for "node $node_name Ready" "$dir/pids/kubelet.pid" \
		"$bin/kubectl" --kubeconfig="$kubeconfig" wait --for=condition=Ready "node/$node_name" --timeout=2s
	trap - EXIT
	say "node $node_name ($node_ip, bridge $bridge) Ready in $((SECONDS - t0))s; state in $dir"
}

# The sandbox image: the pause program from build-bins.sh as a one-file image, cached by the
# binary's hash (it is packed with buildah once per machine, then imported each run).
cmd_import_pause() {
	local bin="$1" cache hash archive ctr mnt
	cache="${PERSPECTIVE_CACHE:-$HOME/.cache/perspective-operator}/images"
	hash="$(sha256sum "$bin/pause" | cut -c1-16)"
	archive="$cache/pause-$hash.tar"
	if [[ ! -f "$archive" ]]; then
		command -v buildah >/dev/null || apt_install "$dir/logs/apt-buildah.log" buildah
		mkdir -p "$cache"
		ctr=$(buildah from scratch)
		mnt=$(buildah mount "$ctr")
		install -m 0755 "$bin/pause" "$mnt/pause"
		buildah umount "$ctr" >/dev/null
		buildah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
		buildah commit -q --rm "$ctr" "$pause_image" >/dev/null
		buildah push -q "$pause_image" "docker-archive:$archive.tmp:$pause_image"
		buildah rmi "$pause_image" >/dev/null || true
		mv -f "$archive.tmp" "$archive"
	fi
	cmd_import "$archive"
}

# A reader image for tests (a pod that queries the database in a loop, as a user's service
# would): the PostgreSQL client's psql binary and every library it links, cached by the binary's
# hash. Its name is $psql_image; it runs as 65532.
cmd_import_psql() {
	local psql cache hash archive ctr mnt lib
	psql="$("$here/../pg/pg.sh" bindir)/psql"
	[[ -x "$psql" ]] || die "no psql at $psql"
	cache="${PERSPECTIVE_CACHE:-$HOME/.cache/perspective-operator}/images"
	hash="$(sha256sum "$psql" | cut -c1-16)"
	archive="$cache/psql-$hash.tar"
	if [[ ! -f "$archive" ]]; then
		command -v buildah >/dev/null || apt_install "$dir/logs/apt-buildah.log" buildah
		mkdir -p "$cache"
		ctr=$(buildah from scratch)
		mnt=$(buildah mount "$ctr")
		install -D -m 0755 "$psql" "$mnt/usr/local/bin/psql"
		for lib in $(ldd "$psql" | grep -o '/[^ ]*'); do
			install -D -m 0755 "$(readlink -f "$lib")" "$mnt$lib"
		done
		mkdir -p "$mnt/etc" "$mnt/tmp"
		chmod 1777 "$mnt/tmp"
		printf 'nonroot:x:65532:65532:nonroot:/tmp:/sbin/nologin\n' >"$mnt/etc/passwd"
		buildah umount "$ctr" >/dev/null
		buildah config --entrypoint '["/usr/local/bin/psql"]' --user 65532:65532 \
			--env HOME=/tmp --workingdir /tmp "$ctr"
		buildah commit -q --rm "$ctr" "$psql_image" >/dev/null
		buildah push -q "$psql_image" "docker-archive:$archive.tmp:$psql_image"
		buildah rmi "$psql_image" >/dev/null || true
		mv -f "$archive.tmp" "$archive"
	fi
	cmd_import "$archive"
}

cmd_import() {
	local sock="$dir/containerd.sock" a
	[[ -S "$sock" ]] || die "no containerd of a node in $dir (start it first)"
	for a in "$@"; do
		[[ -f "$a" ]] || die "no image archive $a"
		ctr -a "$sock" -n k8s.io images import "$a" >"$dir/logs/import.log" 2>&1 ||
			die "importing $a failed: $(cat "$dir/logs/import.log")"
		say "imported $(grep -o 'localhost/[^ ]*' "$dir/logs/import.log" | head -n1 || basename "$a")"
	done
}

cmd_env() {
	[[ -f "$dir/kubelet.yaml" ]] || die "no node state in $dir"
	printf 'export E2E_NODE_NAME=%q E2E_NODE_IP=%q E2E_NODE_SUBNET=%q E2E_NODE_DIR=%q\n' \
		"$node_name" "$node_ip" "$subnet" "$dir"
}

# --- stop --------------------------------------------------------------------

terminate() { # SIGNAL-WAIT-SECONDS PID...
	local wait_s="$1" pid deadline
	shift
	for pid in "$@"; do kill -TERM "$pid" 2>/dev/null || true; done
	deadline=$((SECONDS + wait_s))
	for pid in "$@"; do
		while pid_alive "$pid" && ((SECONDS < deadline)); do sleep 0.1; done
		pid_alive "$pid" && kill -KILL "$pid" 2>/dev/null || true
	done
	return 0
}

cmd_stop() {
	[[ -d "$dir" && -f "$dir/sysctl.saved" ]] || return 0
	# A step that fails must say so: a silent exit here would leave the machine changed.
	trap 'say "stop failed at line $LINENO: $BASH_COMMAND"' ERR
	local t0=$SECONDS pid pids n cg i
	# 1. The kubelet first, so nothing restarts what we stop next.
	pid="$(cat "$dir/pids/kubelet.pid" 2>/dev/null || true)"
	pid_alive "$pid" && terminate 10 "$pid"
	pid="$(cat "$dir/pids/socat.pid" 2>/dev/null || true)"
	pid_alive "$pid" && terminate 2 "$pid"
	pkill -KILL -f "^socat TCP-LISTEN:443,bind=$service_ip," 2>/dev/null || true
	# 2. Every container process (they are in the pod cgroups), then containerd and the shims.
	for i in 1 2 3; do
		mapfile -t pids < <(pod_pids)
		((${#pids[@]})) || break
		kill -KILL "${pids[@]}" 2>/dev/null || true
		sleep 0.2
	done
	mapfile -t pids < <(node_pids)
	((${#pids[@]} == 0)) || terminate 10 "${pids[@]}"
	# 3. Mounts (pod volumes, rootfs, shm, network namespaces), deepest first.
	for i in 1 2 3; do
		mapfile -t mounts < <(our_mounts | awk '{print length, $0}' | sort -rn | cut -d' ' -f2-)
		((${#mounts[@]})) || break
		for m in "${mounts[@]}"; do umount -l "$m" 2>/dev/null || true; done
	done
	rm -f /run/netns/cni-* 2>/dev/null || true
	# 4. Pod cgroups, leaves first (rmdir removes only empty cgroups: nothing alive is lost).
	for i in 1 2 3 4 5; do
		mapfile -t cgs < <(pod_cgroups)
		((${#cgs[@]})) || break
		for cg in "${cgs[@]}"; do
			find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null || true
		done
		sleep 0.2
	done
	# 5. The bridge (the veths went with the network namespaces).
	ip link show "$bridge" >/dev/null 2>&1 && ip link del "$bridge"
	# 6. Kernel settings and iptables chains the kubelet added.
	while IFS='=' read -r k v; do
		[[ "$(sysctl -n "$k")" == "$v" ]] || sysctl -q -w "$k=$v" >/dev/null || say "could not restore $k=$v"
	done <"$dir/sysctl.saved"
	local ipt rule
	while read -r t chain; do
		grep -qxF "$t $chain" "$dir/iptables.preexisting" 2>/dev/null && continue
		ipt=iptables
		[[ "$t" == 6* ]] && ipt=ip6tables && t="${t#6}"
		# Rules that jump to the chain first (e.g. INPUT -j KUBE-FIREWALL), then the chain.
		{ "$ipt" -t "$t" -S | grep -E -- "-j $chain( |\$)" || true; } | sed 's/^-A /-D /' | while read -r rule; do
			# shellcheck disable=SC2086 # a rule is a list of arguments
			"$ipt" -t "$t" $rule 2>/dev/null || true
		done
		"$ipt" -t "$t" -F "$chain" 2>/dev/null || true
		"$ipt" -t "$t" -X "$chain" 2>/dev/null || true
	done < <(iptables_kube_chains)
	# 7. Fixed paths that did not exist before.
	for p in "${fixed_paths[@]}"; do
		grep -qxF "$p" "$dir/paths.preexisting" 2>/dev/null && continue
		[[ -e "$p" || -L "$p" ]] && rm -rf "$p"
	done
	# 8. The state dir (only after the mounts under it are gone).
	if [[ -z "$(our_mounts)" ]]; then
		find "$dir" -mindepth 1 -maxdepth 1 ! -name logs ! -name sysctl.saved ! -name paths.preexisting \
			! -name iptables.preexisting ! -name bindir -exec rm -rf {} + 2>/dev/null || true
	fi
	say "stopped in $((SECONDS - t0))s"
	cmd_check
}

# Nothing of the node may be left: prove it.
cmd_check() {
	[[ -f "$dir/sysctl.saved" ]] || die "no node state in $dir to check against"
	local left=() p k v
	[[ -z "$(node_pids)" ]] || left+=("processes: $(node_pids | tr '\n' ' ')")
	[[ -z "$(pod_pids)" ]] || left+=("container processes: $(pod_pids | tr '\n' ' ')")
	pgrep -f "^socat TCP-LISTEN:443,bind=$service_ip," >/dev/null && left+=("socat forwarder")
	[[ -z "$(our_mounts)" ]] || left+=("mounts: $(our_mounts | tr '\n' ' ')")
	[[ -z "$(pod_cgroups)" ]] || left+=("cgroups: $(pod_cgroups | tr '\n' ' ')")
	ip link show "$bridge" >/dev/null 2>&1 && left+=("bridge $bridge")
	[[ -z "$(ip -br link show type veth 2>/dev/null)" ]] || left+=("veths: $(ip -br link show type veth | cut -d' ' -f1 | tr '\n' ' ')")
	while IFS='=' read -r k v; do
		[[ "$(sysctl -n "$k")" == "$v" ]] || left+=("sysctl $k=$(sysctl -n "$k") (was $v)")
	done <"$dir/sysctl.saved"
	[[ "$(iptables_kube_chains)" == "$(cat "$dir/iptables.preexisting")" ]] || left+=("iptables chains: $(iptables_kube_chains | tr '\n' ' ')")
	for p in "${fixed_paths[@]}"; do
		grep -qxF "$p" "$dir/paths.preexisting" && continue
		[[ -e "$p" || -L "$p" ]] && left+=("path $p")
	done
	if ((${#left[@]})); then
		printf 'node.sh: LEFTOVER after stop: %s\n' "${left[@]}" >&2
		return 1
	fi
	say "clean: no process, mount, cgroup, netns, bridge, sysctl, iptables chain or path left"
}

[[ "${1:-}" == address ]] && {
	echo "$node_ip"
	exit 0
}
[[ $# -ge 2 ]] || usage
cmd="$1"
dir="$(realpath -m "$2")"
shift 2
case "$cmd" in
start)
	[[ $# -eq 1 ]] || usage
	cmd_start "$1"
	;;
import) cmd_import "$@" ;;
env) cmd_env ;;
stop) cmd_stop ;;
check) cmd_check ;;
*) usage ;;
esac
