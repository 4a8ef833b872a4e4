{{- define "loraplane.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "loraplane.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "loraplane.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: loraplane
{{- end -}}

{{- define "loraplane.operatorSelectorLabels" -}}
app.kubernetes.io/name: {{ include "loraplane.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "loraplane.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "loraplane.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "loraplane.serverName" -}}
{{- default (include "loraplane.fullname" .) .Values.server.name -}}
{{- end -}}

{{/* Pods and Services created by the operator for BaseModelServers carry these labels
(loraplane_operator.builders.server_labels; tests/test_helm_chart.py keeps them in step). */}}
{{- define "loraplane.serverPodSelector" -}}
app.kubernetes.io/name: loraplane-server
app.kubernetes.io/component: model-server
{{- end -}}

{{/* The labels that select the chart's server's pods, not its router pods nor other servers' pods
(loraplane_operator.builders.selector_labels: the server Deployment's selector). */}}
{{- define "loraplane.serverSelector" -}}
app.kubernetes.io/name: loraplane-server
loraplane.dev/server: {{ include "loraplane.serverName" . | quote }}
{{- end -}}
