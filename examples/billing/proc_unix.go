//go:build unix && !linux

package main

import "syscall"

// childProcAttr puts the consumer in its own process group, so a terminal's Ctrl-C reaches only
// the orchestrator. Outside Linux there is no parent-death signal; the orchestrator kills the
// consumer on every exit path it controls.
func childProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }
