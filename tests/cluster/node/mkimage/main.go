// Command mkimage writes a single-layer image as a docker-archive tarball (the format
// `ctr images import` and `docker load` read) from files on disk, with no registry and no
// base image. Every timestamp is fixed, so the same inputs give the same image digest.
//
//	mkimage -name localhost/kube-apiserver-proxy/pause:1 -out pause.tar \
//	        -entrypoint /pause ./pause=/pause
//
// A destination may be nested (SRC=/usr/local/bin/NAME); its parent directories are added,
// mode 0755. -env replaces the default PATH=/ and -user sets the image's user, for images
// laid out like the upstream ones.
package main

import (
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// epoch is the time stamped on every file and on the image config.
var epoch = time.Unix(0, 0).UTC()

func main() {
	ref := flag.String("name", "", "image name with tag, e.g. localhost/kube-apiserver-proxy/pause:1")
	out := flag.String("out", "", "docker-archive tarball to write")
	entrypoint := flag.String("entrypoint", "", "entrypoint, space-separated words")
	env := flag.String("env", "PATH=/", "environment, comma-separated NAME=VALUE pairs")
	user := flag.String("user", "", "user of the image, e.g. 65532:65532 (default: root)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: mkimage -name NAME:TAG -out FILE.tar [-entrypoint CMD] [-env K=V,...] [-user UID:GID] SRC=/DEST...")
		flag.PrintDefaults()
	}
	flag.Parse()
	if *ref == "" || *out == "" || flag.NArg() == 0 {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*ref, *out, strings.Fields(*entrypoint), strings.Split(*env, ","), *user, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "mkimage:", err)
		os.Exit(1)
	}
}

func run(ref, out string, entrypoint, env []string, user string, files []string) error {
	tag, err := name.NewTag(ref, name.StrictValidation)
	if err != nil {
		return err
	}
	layerTar, err := buildLayer(files)
	if err != nil {
		return err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	})
	if err != nil {
		return err
	}
	img, err := mutate.AppendLayers(empty.Image, layer)
	if err != nil {
		return err
	}
	cfg, err := img.ConfigFile()
	if err != nil {
		return err
	}
	cfg = cfg.DeepCopy()
	cfg.OS = "linux"
	cfg.Architecture = runtime.GOARCH
	cfg.Created = v1.Time{Time: epoch}
	cfg.Config.Entrypoint = entrypoint
	cfg.Config.Env = env
	cfg.Config.User = user
	cfg.Config.WorkingDir = "/"
	img, err = mutate.ConfigFile(img, cfg)
	if err != nil {
		return err
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	if err := tarball.Write(tag, img, f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// buildLayer makes an uncompressed layer tarball holding /tmp (mode 1777) and each
// SRC=/DEST file, executable, owned by root, with DEST's parent directories (mode 0755).
func buildLayer(files []string) ([]byte, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := &tar.Header{Typeflag: tar.TypeDir, Name: "tmp/", Mode: 0o1777, ModTime: epoch, Format: tar.FormatPAX}
	if err := tw.WriteHeader(dir); err != nil {
		return nil, err
	}
	dirs := map[string]bool{"tmp/": true}
	for _, spec := range files {
		src, dest, ok := strings.Cut(spec, "=")
		if !ok || !strings.HasPrefix(dest, "/") || strings.HasSuffix(dest, "/") || strings.Contains(dest, "//") {
			return nil, fmt.Errorf("file %q: want SRC=/PATH (an absolute file path)", spec)
		}
		parts := strings.Split(strings.TrimPrefix(dest, "/"), "/")
		for i := 1; i < len(parts); i++ {
			d := strings.Join(parts[:i], "/") + "/"
			if dirs[d] {
				continue
			}
			dirs[d] = true
			hdr := &tar.Header{Typeflag: tar.TypeDir, Name: d, Mode: 0o755, ModTime: epoch, Format: tar.FormatPAX}
			if err := tw.WriteHeader(hdr); err != nil {
				return nil, err
			}
		}
		data, err := os.ReadFile(src)
		if err != nil {
			return nil, err
		}
		hdr := &tar.Header{
			Typeflag: tar.TypeReg,
			Name:     strings.TrimPrefix(dest, "/"),
			Mode:     0o755,
			Size:     int64(len(data)),
			ModTime:  epoch,
			Format:   tar.FormatPAX,
		}
		if err := tw.WriteHeader(hdr); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
