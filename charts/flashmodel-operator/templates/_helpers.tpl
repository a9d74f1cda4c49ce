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
{{- with .Values.image.digest }}@{{ . }}{{ end }}
{{- end }}

{{- define "flashmodel-operator.engineImage" -}}
{{- printf "%s:%s" .Values.engineImage.repository (default .Chart.AppVersion .Values.engineImage.tag) }}
{{- with .Values.engineImage.digest }}@{{ . }}{{ end }}
{{- end }}

{{/*
A resource quantity (cpu or memory, e.g. 500m, 0.5, 128Mi, 1G) as a number of base units, for
comparing a request with its limit; the values schema has already checked the form.
*/}}
{{- define "flashmodel-operator.quantity" -}}
{{- $q := toString . -}}
{{- $suffix := regexFind "(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)$" $q -}}
{{- $number := trimSuffix $suffix $q | float64 -}}
{{- $scale := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18
    "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 -}}
{{- mulf $number (get $scale $suffix) -}}
{{- end }}

{{/*
What the values schema cannot compare across fields: a request above its limit (the API server
would refuse the Deployment after the install) and the health and metrics endpoints on one port.
*/}}
{{- define "flashmodel-operator.checks" -}}
{{- $requests := .Values.resources.requests | default dict -}}
{{- range $resource, $limit := .Values.resources.limits | default dict }}
{{- with get $requests $resource }}
{{- if gt (include "flashmodel-operator.quantity" . | float64) (include "flashmodel-operator.quantity" $limit | float64) }}
{{- fail (printf "resources.requests.%s (%v) is above resources.limits.%s (%v): lower the request or raise the limit" $resource . $resource $limit) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.enabled (eq (int .Values.healthPort) (int .Values.metrics.port)) }}
{{- fail (printf "healthPort and metrics.port are both %v: the liveness endpoint and the metrics need a port each" .Values.healthPort) }}
{{- end }}
{{- end }}

{{/* The engine pods' NetworkPolicy peers as the operator reads them (FLASHMODEL_ENGINE_NETWORK_POLICY):
the operator's own pods by namespace and labels, then the values' peers. */}}
{{- define "flashmodel-operator.engineNetworkPolicy" -}}
{{- $ns := dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace) -}}
{{- $pods := dict "matchLabels" (include "flashmodel-operator.selectorLabels" . | fromYaml) -}}
{{- $operator := list (dict "namespaceSelector" $ns "podSelector" $pods) -}}
{{- dict "operator" $operator "apiFrom" .Values.networkPolicy.apiFrom "healthFrom" .Values.networkPolicy.healthFrom | toJson -}}
{{- end }}
