{{/* Names and labels. */}}
{{- define "specserve.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "specserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "specserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "specserve.labels" -}}
{{ include "specserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "specserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "specserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "specserve.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{/* Whether the speculation method runs a draft model or head. */}}
{{- define "specserve.draftMethod" -}}
{{- if has (toString .Values.specserve.unit.engine.speculative.method) (list "draft_model" "eagle") -}}true{{- end -}}
{{- end -}}

{{/* Whether the draft worker group exists: a draft method whose draft has a GPU of its own
(specserve.unit.draft_placement own; shared, the default, runs it in the target pod). */}}
{{- define "specserve.hasDraft" -}}
{{- if and (include "specserve.draftMethod" .) (eq (toString .Values.specserve.unit.draft_placement) "own") -}}true{{- end -}}
{{- end -}}

{{/* Whether the target pods also run each unit's draft, on target rank 0's GPU. */}}
{{- define "specserve.sharedDraft" -}}
{{- if and (include "specserve.draftMethod" .) (not (include "specserve.hasDraft" .)) -}}true{{- end -}}
{{- end -}}

{{- define "specserve.hubTokenSecret" -}}
{{- .Values.hubToken.existingSecret | default (printf "%s-hub-token" (include "specserve.fullname" .)) -}}
{{- end -}}

{{/* "true" unless specserve.auth.enabled is false: API keys are on by default. */}}
{{- define "specserve.authEnabled" -}}
{{- if ne (toString (dig "auth" "enabled" true .Values.specserve)) "false" }}true{{ end -}}
{{- end -}}

{{/*
The keys the chart's own Secret holds: apiKeys.values, else the key generated at the first
install (read back with lookup, so upgrades keep it), else a new random one.
*/}}
{{- define "specserve.apiKeysData" -}}
{{- if .Values.apiKeys.values -}}
{{- join "\n" .Values.apiKeys.values -}}
{{- else -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "specserve.apiKeysSecret" .) -}}
{{- if and $old $old.data (hasKey $old.data .Values.apiKeys.key) -}}
{{- index $old.data .Values.apiKeys.key | b64dec -}}
{{- else -}}
{{- printf "sk-%s" (randAlphaNum 40) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "specserve.apiKeysSecret" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "specserve.fullname" .)) -}}
{{- end -}}

{{- define "specserve.modelCacheClaim" -}}
{{- .Values.modelCache.existingClaim | default (printf "%s-model-cache" (include "specserve.fullname" .)) -}}
{{- end -}}

{{/*
The application config as the Serve app receives it: the values' `specserve` AppConfig (its
draft dropped unless method is draft_model or eagle) plus the node resources that pin the coordinator
and target ranks to target pods and the draft to draft pods (the worker groups advertise them;
a draft sharing rank 0's GPU stays in the target pod).
*/}}
{{- define "specserve.appConfig" -}}
{{- $spec := .Values.specserve.unit.engine.speculative -}}
{{- if not (include "specserve.draftMethod" .) -}}
{{- /* values.yaml's default draft means nothing without a draft method (and is refused) */ -}}
{{- $spec = omit $spec "draft" -}}
{{- end -}}
{{- $engine := merge (dict "speculative" $spec) (omit .Values.specserve.unit.engine "speculative") -}}
{{- $unit := merge (dict "target_node_resource" "specserve_target" "engine" $engine) (omit .Values.specserve.unit "engine") -}}
{{- if include "specserve.hasDraft" . -}}
{{- $unit = merge (dict "draft_node_resource" "specserve_draft") $unit -}}
{{- end -}}
{{- $app := merge (dict "unit" $unit "ingress_node_resource" "specserve_head") (omit .Values.specserve "unit") -}}
{{- toYaml $app -}}
{{- end -}}

{{/* Env, volumes and mounts shared by every Ray container. */}}
{{- define "specserve.env" -}}
- name: SPECSERVE_CACHE_DIR
  value: /models/cache
- name: HF_HOME
  value: /models/hf
{{- if or .Values.hubToken.value .Values.hubToken.existingSecret }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "specserve.hubTokenSecret" . }}
      key: {{ .Values.hubToken.key }}
{{- end }}
{{- if include "specserve.authEnabled" . }}
- name: SPECSERVE_API_KEYS_FILE
  value: /etc/specserve/api-keys/{{ .Values.apiKeys.key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "specserve.volumes" -}}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shm }}
{{- if .root.Values.modelCache.enabled }}
- name: model-cache
  persistentVolumeClaim:
    claimName: {{ include "specserve.modelCacheClaim" .root }}
{{- end }}
{{- if include "specserve.authEnabled" .root }}
- name: api-keys
  secret:
    secretName: {{ include "specserve.apiKeysSecret" .root }}
{{- end }}
{{- end -}}

{{- define "specserve.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if .Values.modelCache.enabled }}
- name: model-cache
  mountPath: /models
{{- end }}
{{- if include "specserve.authEnabled" . }}
- name: api-keys
  mountPath: /etc/specserve/api-keys
  readOnly: true
{{- end }}
{{- end -}}
