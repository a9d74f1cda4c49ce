{{/* Names and labels shared by every template (the standard helm create names). */}}

{{/* The chart name, or nameOverride. */}}
{{- define "flashmodel-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The resource-name prefix: fullnameOverride, or release-chart (just the release name when it
already contains the chart name). 63 characters because names end up in labels.
*/}}
{{- define "flashmodel-operator.fullname" -}}
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

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "flashmodel-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "flashmodel-operator.labels" -}}
helm.sh/chart: {{ include "flashmodel-operator.chart" . }}
{{ include "flashmodel-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flashmodel
{{- end }}

{{/*
Selector labels: immutable in a Deployment's selector, so nothing here may change on upgrade
(no chart or app version).
*/}}
{{- define "flashmodel-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flashmodel-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount the operator runs as. */}}
{{- define "flashmodel-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "flashmodel-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kopf peering object's name (used only when replicaCount > 1). */}}
{{- define "flashmodel-operator.peeringName" -}}
{{- default (include "flashmodel-operator.fullname" .) .Values.peering.name }}
{{- end }}

{{/* Whether more than one operator pod runs, so kopf peering must pick the active one. */}}
{{- define "flashmodel-operator.peered" -}}
{{- if gt (int .Values.replicaCount) 1 }}true{{ end }}
{{- end }}

{{/* The operator image reference. */}}
{{- define "flashmodel-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
