{{/* Names and labels shared by every object of a release. */}}
{{- define "g5g.fullname" -}}
{{- printf "%s-%s" .Release.Name .Values.runtime | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{- define "g5g.selector" -}}
app.kubernetes.io/name: g5g-serving
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: {{ .Values.runtime }}
{{- end -}}

{{- define "g5g.labels" -}}
{{ include "g5g.selector" . }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Values.image.tag | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
g5g.io/profile: {{ .Values.profile }}
{{- end -}}

{{/* The drain (--shutdown-timeout): the longest reply the chart allows (maxModelLen tokens) at one stream's
     measured T4G decode speed, unless drain.shutdownTimeoutSeconds names it. */}}
{{- define "g5g.drainSeconds" -}}
{{- $d := .Values.drain -}}
{{- if $d.shutdownTimeoutSeconds -}}
{{ $d.shutdownTimeoutSeconds }}
{{- else -}}
{{ divf .Values.maxModelLen $d.decodeTokensPerSecond | ceil | int }}
{{- end -}}
{{- end -}}

{{/* Where a fetched model lives in its cache volume: one directory per source, so a new revision is a new fetch. */}}
{{- define "g5g.modelDir" -}}
{{- $m := .Values.model -}}
{{- $spec := ternary (printf "hf:%s@%s" $m.huggingface.repo $m.huggingface.revision) (printf "s3:%s" $m.s3.uri) (eq $m.source "huggingface") -}}
{{ printf "%s-%s" (base (ternary $m.huggingface.repo $m.s3.uri (eq $m.source "huggingface")) | trimSuffix "/" | lower) ($spec | sha256sum | trunc 12) }}
{{- end -}}

{{- define "g5g.image" -}}
{{- if .Values.image.digest -}}
{{ printf "%s:%s@%s" .Values.image.repository .Values.image.tag .Values.image.digest }}
{{- else -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end -}}
{{- end -}}

{{- define "g5g.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}
