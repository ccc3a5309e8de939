//go:build linux

package main

import "syscall"

// childProcAttr puts the consumer in its own process group, so a terminal's Ctrl-C reaches only
// the orchestrator (which then kills the consumer), and makes the kernel SIGKILL the consumer
// when the orchestrator dies, so no run leaves a consumer behind.
func childProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
