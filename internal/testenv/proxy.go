package testenv

import (
	"io"
	"net"
	"sync"
	"testing"
)

// Proxy is a TCP proxy for fault injection between a client and a real server on loopback.
// Hold stops forwarding server-to-client bytes on every connection open at that moment (the
// server's answers are lost in the network, as in a partition after the request was sent);
// connections opened later are not held.
type Proxy struct {
	// Addr is the proxy's listening address, host:port on 127.0.0.1.
	Addr string

	ln     net.Listener
	target string
	mu     sync.Mutex
	conns  []*proxiedConn
}

type proxiedConn struct {
	client, server net.Conn
	mu             sync.Mutex
	held           bool
}

// NewProxy listens on 127.0.0.1 and forwards every connection to target; it closes when t ends.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &Proxy{Addr: ln.Addr().String(), ln: ln, target: target}
	go p.accept()
	t.Cleanup(p.Close)
	return p
}

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		pc := &proxiedConn{client: c, server: s}
		p.mu.Lock()
		p.conns = append(p.conns, pc)
		p.mu.Unlock()
		go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
		go pc.serverToClient()
	}
}

func (pc *proxiedConn) serverToClient() {
	buf := make([]byte, 32<<10)
	for {
		n, err := pc.server.Read(buf)
		if n > 0 {
			pc.mu.Lock()
			held := pc.held
			pc.mu.Unlock()
			if !held {
				if _, werr := pc.client.Write(buf[:n]); werr != nil {
					return
				}
			}
		}
		if err != nil {
			_ = pc.client.Close()
			return
		}
	}
}

// Hold drops, from now on, every byte the server sends on the connections open now.
func (p *Proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		pc.mu.Lock()
		pc.held = true
		pc.mu.Unlock()
	}
}

// Close stops listening and closes every proxied connection.
func (p *Proxy) Close() {
	_ = p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, pc := range p.conns {
		_ = pc.client.Close()
		_ = pc.server.Close()
	}
}
