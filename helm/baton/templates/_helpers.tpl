{{- define "baton.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{ end }}
{{- end }}

{{- define "baton.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The pools this cluster config has: both, or decode alone in colocated mode. */}}
{{- define "baton.pools" -}}
{{- if eq (default "disaggregated" .Values.cluster.mode) "colocated" }}["decode"]{{ else }}["prefill","decode"]{{ end }}
{{- end }}

{{/* Where pods find the model (empty: the image's builtin default). */}}
{{- define "baton.modelPath" -}}
{{- if eq .Values.model.source "huggingface" }}/models/{{ base .Values.model.id }}
{{- else if eq .Values.model.source "volume" }}{{ trimSuffix "/" .Values.model.volume.mountPath }}/{{ .Values.model.volume.path }}
{{- end }}
{{- end }}

{{/* The Baton cluster config as JSON: values.cluster, with what the pods decide (listen address, model path,
     each pool's worker-group resource) filled in. */}}
{{- define "baton.clusterConfig" -}}
{{- $c := deepCopy .Values.cluster }}
{{- $_ := set $c "host" "0.0.0.0" }}
{{- $_ := set $c "port" 8000 }}
{{- $model := include "baton.modelPath" . }}
{{- if $model }}{{ $_ := set $c "model" $model }}{{ end }}
{{- range $pool := include "baton.pools" . | fromJsonArray }}
{{- $p := get $c $pool | default dict }}
{{- $res := get $p "resources" | default dict }}
{{- $_ := set $res (printf "baton_%s" $pool) 1 }}
{{- $_ := set $p "resources" $res }}
{{- $_ := set $c $pool $p }}
{{- end }}
{{- toJson $c }}
{{- end }}

{{/* GPUs per replica are its TP size (cluster/config.py PoolConfig.tp_problems): refuse a pool whose num_gpus
     is neither 0 nor engine.tensor_parallel_size (a fraction is allowed at TP 1: replicas sharing a GPU).
     Called with (list pool-name pool-config). */}}
{{- define "baton.checkTensorParallel" -}}
{{- $pool := index . 0 }}{{- $p := index . 1 }}
{{- $gpus := float64 (get $p "num_gpus" | default 0) }}
{{- $tp := int (dig "engine" "tensor_parallel_size" 1 $p | default 1) }}
{{- if and (gt $gpus 0.0) (ne $gpus (float64 $tp)) (or (gt $tp 1) (gt $gpus 1.0)) }}
{{- fail (printf "cluster.%s.num_gpus: %v but cluster.%s.engine.tensor_parallel_size is %d: a replica takes one GPU per rank (set both to the GPUs it should use, or num_gpus 0 for none)" $pool $gpus $pool $tp) }}
{{- end }}
{{- end }}

{{/* The Serve config: what cluster.app.serve_config(config, proxy_location="EveryNode") returns. */}}
{{- define "baton.serveConfig" -}}
{{- $c := include "baton.clusterConfig" . | fromJson }}
{{- /* a fixed pool's size goes to a deployment override, so resizing it is an in-place update, not a roll */}}
{{- $deployments := list }}
{{- range $pool := include "baton.pools" . | fromJsonArray }}
{{- $p := get $c $pool }}
{{- if not (get $p "autoscaling") }}
{{- $deployments = append $deployments (dict "name" $pool "num_replicas" (get $p "num_replicas" | default 1 | int)) }}
{{- $_ := unset $p "num_replicas" }}
{{- end }}
{{- end }}
proxy_location: EveryNode
http_options:
  host: 0.0.0.0
  port: 8000
applications:
  - name: baton
    route_prefix: /
    import_path: cluster.app:app_builder
    args:
      config: {{ toJson $c }}
      app_name: baton
    {{- if or (dig "prefill" "autoscaling" nil $c) (dig "decode" "autoscaling" nil $c) }}
    autoscaling_policy:
      policy_function: cluster.autoscaling:CoupledPolicy
    {{- end }}
    {{- with $deployments }}
    deployments: {{ toJson . }}
    {{- end }}
{{- end }}

{{/* Volumes, mounts, env and init containers every Ray pod needs for the model. */}}
{{- define "baton.modelVolumes" -}}
{{- if eq .Values.model.source "huggingface" }}
- name: model
  emptyDir: {}
{{- else if eq .Values.model.source "volume" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.volume.claimName is required with model.source volume" .Values.model.volume.claimName }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "baton.modelMounts" -}}
{{- if eq .Values.model.source "huggingface" }}
- name: model
  mountPath: /models
{{- else if eq .Values.model.source "volume" }}
- name: model
  mountPath: {{ .Values.model.volume.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "baton.env" -}}
{{- include "baton.hfToken" . }}
{{- range $name, $value := .Values.ray.env }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- if .Values.apiKeys.secretName }}
- name: {{ dig "auth" "api_keys_env" "BATON_API_KEYS" .Values.cluster }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.secretName }}
      key: {{ .Values.apiKeys.key }}
{{- end }}
{{- end }}

{{- define "baton.hfToken" -}}
{{- if .Values.model.tokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.tokenSecret.name }}
      key: {{ .Values.model.tokenSecret.key }}
{{- end }}
{{- end }}

{{- define "baton.initContainers" -}}
{{- if eq .Values.model.source "huggingface" }}
initContainers:
  - name: download-model
    image: "{{ .Values.image.repository }}:{{ .Values.image.tag }}"
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["python", "-c", "import sys; from huggingface_hub import snapshot_download; snapshot_download(repo_id=sys.argv[1], local_dir=sys.argv[2])", {{ .Values.model.id | quote }}, {{ include "baton.modelPath" . | quote }}]
    {{- if .Values.model.tokenSecret.name }}
    env:
      {{- include "baton.hfToken" . | nindent 6 }}
    {{- end }}
    volumeMounts:
      {{- include "baton.modelMounts" . | nindent 6 }}
{{- end }}
{{- end }}
