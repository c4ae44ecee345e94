{{/*
Names, labels and shared pieces of the shardserve chart.
*/}}

{{- define "shardserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every object name: <release>-<chart>, or the release name when it already holds the
chart's name (63 characters at most, a DNS label).
*/}}
{{- define "shardserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "shardserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "shardserve.labels" -}}
helm.sh/chart: {{ include "shardserve.chart" . }}
{{ include "shardserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shardserve
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "shardserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "shardserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The coordinator's Deployment and Service. */}}
{{- define "shardserve.coordinatorName" -}}
{{- printf "%s-coordinator" (include "shardserve.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* host:port the workers (and the helm test) reach the coordinator at. */}}
{{/* The coordinator's control port, which workers register on. */}}
{{- define "shardserve.coordinatorAddress" -}}
{{- printf "%s.%s.svc.%s:%d" (include "shardserve.coordinatorName" .) .Release.Namespace .Values.clusterDomain (int .Values.coordinator.controlPort) }}
{{- end }}

{{/* The coordinator's public gRPC API, which clients use. */}}
{{- define "shardserve.coordinatorPublicAddress" -}}
{{- printf "%s.%s.svc.%s:%d" (include "shardserve.coordinatorName" .) .Release.Namespace .Values.clusterDomain (int .Values.coordinator.grpcPort) }}
{{- end }}

{{/* The Secret holding a role's tls.crt, tls.key and ca.crt (args: dict "root" . "role" "coordinator"|"worker"). */}}
{{- define "shardserve.tlsSecretName" -}}
{{- $root := .root }}
{{- if eq $root.Values.tls.source "existingSecrets" }}
{{- index $root.Values.tls.existingSecrets .role }}
{{- else }}
{{- printf "%s-%s-tls" (include "shardserve.fullname" $root) .role | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Flags, volume mounts and volumes of TLS and API keys (args: dict "root" . "role" "coordinator"|"worker"). */}}
{{- define "shardserve.securityArgs" -}}
{{- if .root.Values.tls.enabled }}
- --tls_dir=/etc/shardserve/tls
- --tls_refresh_s={{ int .root.Values.tls.refreshSeconds }}
{{- end }}
{{- if and (eq .role "coordinator") .root.Values.apiKeys.existingSecret }}
- --api_keys_file=/etc/shardserve/api-keys/{{ .root.Values.apiKeys.key }}
{{- end }}
{{- end }}

{{- define "shardserve.securityVolumeMounts" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  mountPath: /etc/shardserve/tls
  readOnly: true
{{- end }}
{{- if and (eq .role "coordinator") .root.Values.apiKeys.existingSecret }}
- name: api-keys
  mountPath: /etc/shardserve/api-keys
  readOnly: true
{{- end }}
{{- end }}

{{- define "shardserve.securityVolumes" -}}
{{- if .root.Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ include "shardserve.tlsSecretName" . }}
{{- end }}
{{- if and (eq .role "coordinator") .root.Values.apiKeys.existingSecret }}
- name: api-keys
  secret:
    secretName: {{ .root.Values.apiKeys.existingSecret }}
{{- end }}
{{- end }}

{{- define "shardserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "shardserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
An image reference. Call with (dict "image" IMAGE "default" DEFAULT_TAG "root" $).
*/}}
{{- define "shardserve.image" -}}
{{- $repository := .image.repository }}
{{- with .root.Values.image.registry }}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}
{{- end }}
{{- if .image.digest }}
{{- printf "%s@%s" $repository .image.digest }}
{{- else }}
{{- printf "%s:%s" $repository (default .default .image.tag | toString) }}
{{- end }}
{{- end }}

{{- define "shardserve.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets -}}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* A parallelism value as the coordinator's flag wants it: "auto" is 0. */}}
{{- define "shardserve.parallelismFlag" -}}
{{- if eq (toString .) "auto" }}0{{ else }}{{ int . }}{{ end }}
{{- end }}

{{/*
The worker groups as a list of dicts: the main group ("worker", whose key is empty) and then each
of extraWorkerGroups with its keys replacing the worker's. Each dict gets "groupName",
"resourceName" (its StatefulSet and headless Service) and "devicesFlag". Call with $; returns JSON
(use: fromJsonArray).
*/}}
{{- define "shardserve.workerGroups" -}}
{{- $groups := list }}
{{- $base := .Values.worker }}
{{- $all := prepend .Values.extraWorkerGroups (dict "name" "") }}
{{- range $all }}
{{- $g := deepCopy $base }}
{{- range $k, $v := omit . "name" }}
{{- $_ := set $g $k $v }}
{{- end }}
{{- $suffix := ternary "" (printf "-%s" .name) (eq .name "") }}
{{- $_ := set $g "groupName" (default "default" .name) }}
{{- /* StatefulSet names stay within 52 characters: their pods' controller-revision-hash label adds 11. */}}
{{- $_ := set $g "resourceName" (printf "%s-worker%s" (include "shardserve.fullname" $) $suffix | trunc 52 | trimSuffix "-") }}
{{- $devices := $g.devices }}
{{- if not $devices }}
{{- if gt (int $g.gpus) 0 }}
{{- $devices = "cuda:all" }}
{{- else }}
{{- $devices = printf "cpu:%d" (int $g.cpuRanks) }}
{{- end }}
{{- end }}
{{- $_ := set $g "devicesFlag" $devices }}
{{- $groups = append $groups $g }}
{{- end }}
{{- toJson $groups }}
{{- end }}

{{/* Ranks of one worker group's workers, for the tp check; 0 when --devices lists them. */}}
{{- define "shardserve.groupRanks" -}}
{{- if .devices }}0{{ else if gt (int .gpus) 0 }}{{ int .gpus }}{{ else }}{{ int .cpuRanks }}{{ end }}
{{- end }}

{{/*
Checks across values that the schema cannot express; fails the install with the reason.
*/}}
{{- define "shardserve.validate" -}}
{{- $groups := include "shardserve.workerGroups" . | fromJsonArray }}
{{- $total := 0 }}
{{- $maxRanks := 0 }}
{{- $listed := false }}
{{- $names := dict }}
{{- range $groups }}
{{- $total = add $total (int .replicas) }}
{{- if hasKey $names .groupName }}
{{- fail (printf "extraWorkerGroups: the group name %q is used twice (or is \"default\", the name of the main worker group)" .groupName) }}
{{- end }}
{{- $_ := set $names .groupName true }}
{{- if hasKey $names (printf "resource:%s" .resourceName) }}
{{- fail (printf "the worker group %q gets the name %q of another group once cut to 52 characters: use a shorter release name, fullnameOverride or group name" .groupName .resourceName) }}
{{- end }}
{{- $_ := set $names (printf "resource:%s" .resourceName) true }}
{{- if and (gt (int .drainTimeoutSeconds) 0) (lt (int .terminationGracePeriodSeconds) (add (int .drainTimeoutSeconds) 15)) }}
{{- fail (printf "worker group %q: terminationGracePeriodSeconds (%d) must be at least drainTimeoutSeconds (%d) + 15, or Kubernetes kills a worker before its drain ends" .groupName (int .terminationGracePeriodSeconds) (int .drainTimeoutSeconds)) }}
{{- end }}
{{- $ranks := include "shardserve.groupRanks" . | int }}
{{- if eq $ranks 0 }}{{ $listed = true }}{{ end }}
{{- if gt $ranks $maxRanks }}{{ $maxRanks = $ranks }}{{ end }}
{{- end }}
{{- if lt $total 1 }}
{{- fail "worker.replicas and extraWorkerGroups[].replicas add up to 0: the cluster needs at least one worker" }}
{{- end }}
{{- $tp := .Values.parallelism.tp }}
{{- if and (ne (toString $tp) "auto") (not $listed) (gt (int $tp) $maxRanks) }}
{{- fail (printf "parallelism.tp=%d but no worker has more than %d device(s): a pipeline stage runs on one worker, so tp cannot exceed its GPUs (worker.gpus) or CPU ranks (worker.cpuRanks)" (int $tp) $maxRanks) }}
{{- end }}
{{- $pp := .Values.parallelism.pp }}
{{- $replicas := .Values.parallelism.replicas }}
{{- $stages := 1 }}
{{- if ne (toString $pp) "auto" }}{{ $stages = int $pp }}{{ end }}
{{- if ne (toString $replicas) "auto" }}{{ $stages = mul $stages (int $replicas) }}{{ end }}
{{- if gt $stages $total }}
{{- fail (printf "parallelism asks for %d pipeline stage(s) (pp x replicas) but the chart runs %d worker(s): each stage needs a worker of its own (raise worker.replicas)" $stages $total) }}
{{- end }}
{{- $mount := trimSuffix "/" .Values.model.mountPath }}
{{- if not (or (eq (trimSuffix "/" .Values.model.path) $mount) (hasPrefix (printf "%s/" $mount) .Values.model.path)) }}
{{- fail (printf "model.path (%s) must be model.mountPath (%s) or a folder below it" .Values.model.path .Values.model.mountPath) }}
{{- end }}
{{- if eq (int .Values.coordinator.grpcPort) (int .Values.metrics.port) }}
{{- fail "coordinator.grpcPort and metrics.port must differ" }}
{{- end }}
{{- if and .Values.tls.enabled (eq .Values.tls.source "existingSecrets") (or (not .Values.tls.existingSecrets.coordinator) (not .Values.tls.existingSecrets.worker)) }}
{{- fail "tls.source existingSecrets needs tls.existingSecrets.coordinator and tls.existingSecrets.worker (Secrets with tls.crt, tls.key and ca.crt)" }}
{{- end }}
{{- if or (eq (int .Values.coordinator.controlPort) (int .Values.coordinator.grpcPort)) (eq (int .Values.coordinator.controlPort) (int .Values.metrics.port)) (and .Values.coordinator.http.enabled (eq (int .Values.coordinator.controlPort) (int .Values.coordinator.http.port))) }}
{{- fail "coordinator.controlPort must differ from coordinator.grpcPort, coordinator.http.port and metrics.port" }}
{{- end }}
{{- if eq (int .Values.worker.grpcPort) (int .Values.metrics.port) }}
{{- fail "worker.grpcPort and metrics.port must differ" }}
{{- end }}
{{- if and .Values.coordinator.http.enabled (or (eq (int .Values.coordinator.http.port) (int .Values.coordinator.grpcPort)) (eq (int .Values.coordinator.http.port) (int .Values.metrics.port))) }}
{{- fail "coordinator.http.port must differ from coordinator.grpcPort and metrics.port" }}
{{- end }}
{{- end }}

{{/* The model volume of a pod. */}}
{{- define "shardserve.modelVolume" -}}
- name: model
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required with model.source=pvc" .Values.model.pvc.claimName }}
    readOnly: {{ .Values.model.pvc.readOnly }}
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ required "model.hostPath.path is required with model.source=hostPath" .Values.model.hostPath.path }}
    type: {{ .Values.model.hostPath.type }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.model.initContainer.sizeLimit }}
{{- end }}
{{- end }}

{{- define "shardserve.modelVolumeMount" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
{{- if eq .Values.model.source "pvc" }}
  readOnly: {{ .Values.model.pvc.readOnly }}
{{- with .Values.model.pvc.subPath }}
  subPath: {{ . }}
{{- end }}
{{- else if eq .Values.model.source "hostPath" }}
  readOnly: true
{{- else }}
  readOnly: true
{{- end }}
{{- end }}

{{/*
The init container that downloads the model (model.source=initContainer).
Call with (dict "root" $ "role" "coordinator"|"worker").
*/}}
{{- define "shardserve.modelInitContainer" -}}
{{- $root := .root }}
{{- $m := $root.Values.model }}
{{- if eq $m.source "initContainer" -}}
- name: fetch-model
  image: {{ include "shardserve.image" (dict "image" $m.initContainer.image "default" "latest" "root" $root) }}
  imagePullPolicy: {{ $root.Values.image.pullPolicy }}
  command:
    - /bin/sh
    - -c
    - |
{{ tpl $m.initContainer.script $root | trimSuffix "\n" | indent 6 }}
  env:
    - name: MODEL_DIR
      value: {{ $m.path | quote }}
    - name: SHARDSERVE_ROLE
      value: {{ .role }}
    - name: HF_REPO
      value: {{ $m.initContainer.huggingfaceRepo | quote }}
    - name: HF_REVISION
      value: {{ $m.initContainer.huggingfaceRevision | quote }}
{{- with $m.initContainer.huggingfaceTokenSecret }}
    - name: HF_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ . }}
          key: HF_TOKEN
{{- end }}
{{- with $m.initContainer.env }}
{{ toYaml . | indent 4 }}
{{- end }}
{{- with $m.initContainer.resources }}
  resources:
{{ toYaml . | indent 4 }}
{{- end }}
  securityContext:
{{ toYaml $root.Values.securityContext | indent 4 }}
  volumeMounts:
    - name: model
      mountPath: {{ $m.mountPath }}
    - name: tmp
      mountPath: /tmp
{{- end }}
{{- end }}

{{/* Probe timings from a values block. */}}
{{- define "shardserve.probeTimings" -}}
initialDelaySeconds: {{ .initialDelaySeconds }}
periodSeconds: {{ .periodSeconds }}
timeoutSeconds: {{ .timeoutSeconds }}
failureThreshold: {{ .failureThreshold }}
{{- end }}
