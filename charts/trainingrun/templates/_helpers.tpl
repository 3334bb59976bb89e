{{/* Name of the chart, overridable. */}}
{{- define "trainingrun.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name of the release's resources: <release>-<name>, or the release name when it already holds the name. */}}
{{- define "trainingrun.fullname" -}}
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

{{/* chart label value: name-version. */}}
{{- define "trainingrun.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels of every object of the release. */}}
{{- define "trainingrun.labels" -}}
helm.sh/chart: {{ include "trainingrun.chart" . }}
{{ include "trainingrun.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: trainingrun
{{- end }}

{{/* Labels selecting the operator pod. The name is suffixed "-operator" so the operator pod is never mistaken for
a run's pod (those carry app.kubernetes.io/name: trainingrun). */}}
{{- define "trainingrun.selectorLabels" -}}
app.kubernetes.io/name: {{ include "trainingrun.name" . }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "trainingrun.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "trainingrun.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image: repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "trainingrun.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else if eq .Values.image.tag "latest" }}
{{- fail "image.tag: \"latest\" is not allowed (it is not reproducible); set a release tag or image.digest" }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* RBAC rules of the operator (files/rbac-rules.yaml; a test keeps them equal to trainingrun.operator.rbac).
scope "namespaced": namespaced resources; "cluster": cluster-scoped resources; "gang": PodGroups. */}}
{{- define "trainingrun.rbacRules" -}}
{{- $all := .Files.Get "files/rbac-rules.yaml" | fromYaml }}
{{- toYaml (get $all .scope) }}
{{- end }}
