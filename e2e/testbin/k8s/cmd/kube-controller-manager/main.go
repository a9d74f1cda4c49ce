// Command kube-controller-manager mirrors upstream k8s.io/kubernetes/cmd/kube-controller-manager so it can be built from published modules.
package main

import (
	"os"
	_ "time/tzdata" // upstream embeds tzdata so CronJob time zones work without the OS database

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/kube-controller-manager/app"
)

func main() { os.Exit(cli.Run(app.NewControllerManagerCommand())) }
