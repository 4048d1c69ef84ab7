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
